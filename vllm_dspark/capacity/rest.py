"""sps at rest: while its admission has settled on every draft, the controller stops
planning for a while.

On a host-bound pair (the embedded one) the controller's own host work per step (the
proposal's statistics and their copies, the draft gate, the admission, the step overhead's
bookkeeping) is most of what separates sps from fixed depth: in one engine, with every
draft admitted and the same acceptance, sps ran 0.83-0.85x fixed k=7 at one request, its
steps 2.95 against 2.35 ms (8791c92, H100). There no admission gains anything: the target's
forward is a tenth of the step, and compacting costs more than it saves (the compaction
premium, :mod:`step_overhead`), so sps verifies every draft and pays for deciding so.

Once REST_AFTER consecutive readings of fresh proposals' statistics (:mod:`stale_record`)
want every draft verified, at full depth, the draft gate open, the next REST_PROPOSALS
proposals run as fixed depth: vLLM's own step, no statistics, gate or admission. Then
the controller plans again, and rests again only once as many fresh readings agree; a
rest that follows another with no reading between them wanting fewer drafts lasts twice
as long, up to REST_LONGEST (at 128 proposals the ~10 planning steps around each rest were
7-12% of the embedded pair's proposals, 9da6cdd, H100). A batch that grows past
REST_GROWTH times its size at the rest's start wakes it early: more requests make each
verified draft dearer (a steeper curve, a larger forward to save), and compacting may pay
again. A shrinking one does not: with fewer requests every cost the admission weighs (the
forward saved, b per draft) shrinks against O and C, so every draft stays worth
verifying, and a draining batch (the embedded pair's at 256 requests: 256 to 1 over ~60
steps) would otherwise wake it every few steps. A wake by growth, or a reading that wants
fewer drafts, brings the next rest back to REST_PROPOSALS. Where the controller reads every
step's verification (calibration metrics, online STS) it never rests.

Lossless: whether a step rests is a function of earlier proposals' statistics, the
proposal count and the batch size, never of the drafts it verifies (a resting step
verifies all of them, as vLLM does); and the same on every tensor-parallel rank, whose
statistics agree.
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
