"""sps at rest: while its admission has settled on every draft, the controller stops
planning for a while.

On a host-bound pair the controller's own host work per step (statistics and their copies,
the draft gate, the admission, the overhead bookkeeping) is most of what separates sps from
fixed depth, and where compacting costs more than it saves sps verifies every draft anyway.
So once ``REST_AFTER`` consecutive fresh readings want every draft verified, at full depth
with the gate open, the next ``REST_PROPOSALS`` proposals run as fixed depth (vLLM's own
step, no statistics, gate or admission). Rests that follow each other without a reading
wanting fewer drafts double, up to ``REST_LONGEST``. A batch grown ``REST_GROWTH`` times
wakes a rest early (each verified draft gets dearer); a shrinking one does not (every draft
stays worth verifying). Where the controller reads every step's verification (calibration
metrics, online STS) it never rests.

Lossless: whether a step rests depends on earlier proposals' statistics, the proposal count
and the batch size, never on the drafts it verifies (a resting step verifies all of them),
and is the same on every tensor-parallel rank.
"""

from __future__ import annotations

# Fresh readings wanting every draft before a rest: a few steps of one batch, so that a
# step or two of a batch on its way elsewhere does not start one.
REST_AFTER = 8
# Proposals the first rest lasts: the controller then plans about 10 of every 138 steps (2
# to read fresh statistics after waking, then REST_AFTER).
REST_PROPOSALS = 128
# ... and the longest, reached by doubling while rests follow each other: 10 of every 1,034
# steps plan. What a rest does not read (a stretch of doubtful drafts) waits at most as
# long; a growing batch, what could make compaction pay, wakes it at once.
REST_LONGEST = 8 * REST_PROPOSALS
# A batch this many times larger than at the rest's start wakes it.
REST_GROWTH = 1.5


class AdmissionRest:
    def __init__(self):
        self.left = 0  # proposals still to rest (0: planning)
        self.length = REST_PROPOSALS  # proposals the next rest lasts
        self.streak = 0  # consecutive fresh readings wanting every draft
        self.batch = 0  # requests at the rest's start
        self.fresh_from = 0  # readings of records made from this one on are fresh
        self.rests = 0
        self.proposals_rested = 0

    @property
    def resting(self) -> bool:
        return self.left > 0

    def observe(self, wants_all: bool, record_read: int, num_reqs: int) -> None:
        """After the admission read the statistics of record ``record_read``: whether they
        (and the controller's state) wanted every draft verified."""
        if record_read < self.fresh_from:
            return  # made before the last rest: already counted
        self.streak = self.streak + 1 if wants_all else 0
        if not wants_all:
            self.length = REST_PROPOSALS
        if self.streak >= REST_AFTER:
            self.streak, self.left, self.batch = 0, self.length, num_reqs
            self.length = min(2 * self.length, REST_LONGEST)
            self.rests += 1

    def take_proposal(self, num_reqs: int, records_made: int) -> bool:
        """At a real proposal: whether it rests. The one that ends a rest plans (and its
        record, the ``records_made``-th, is the first fresh one)."""
        if not self.left:
            return False
        self.left -= 1
        grown = num_reqs > self.batch * REST_GROWTH
        if self.left and not grown:
            self.proposals_rested += 1
            return True
        if grown:
            self.length = REST_PROPOSALS
        self.left, self.fresh_from = 0, records_made
        return False
