"""Whether a proposal is worth drafting at all at this load (``sps`` with ``auto``).

The drafter's time is spent whatever ``sps`` admits, so under load a speculative step can
cost more than it gains even at its best admission; then the fastest choice is not to
draft. Before each proposal the gate weighs the expected tokens per second of drafting and
verifying j positions per request,

    R (1 + s_1 + ... + s_j) / (1 / SPS(R (1 + j)) + D(R) + O + b R j + C [j < K]),

against not drafting, R / (1 / SPS(R) + O + S + C), or with plain steps R / (1 / SPS(R) + P)
(costs from :mod:`step_overhead`). Where a recent proposal of at least ``SURVIVAL_MEMORY``
requests is at hand, drafting is valued by its own slots as ``sps`` would admit them
(:func:`~vllm_dspark.capacity.allocation.best_rates_by_depth`), since mean survivals
undervalue drafting where confidence varies between requests. With dynamic depth each
shallower depth is weighed at its own D(R). The gate drafts when the best wins, with a
``HYSTERESIS`` either way; while closed it probes every ``PROBE_EVERY`` skipped proposals
(``PLAIN_PROBE_BURST`` in a row with plain steps, so the probe's steps get timed).
``gate_objective=batch`` weighs the slowest request's survivals instead (a batch lasts as
long as its slowest request). Host arithmetic on values every rank reads alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_dspark.capacity.allocation import best_rates_by_depth, masked_forward_table
from vllm_dspark.capacity.stale_record import StalePerRequest

HYSTERESIS = 0.02
PROBE_EVERY = 64  # skipped proposals in a row before one is drafted to refresh survivals
# With plain steps: proposals a probe drafts in a row, so that a step verifying drafts at
# this load is timed. vLLM's async scheduler gives drafts to the last two of four (it takes
# a verdict late), and the first drafting step after plain ones is a transition
# (tests/cpu/test_plain_steps.py, the acceptance gate through the scheduler).
PLAIN_PROBE_BURST = 4
SURVIVAL_MEMORY = 64  # requests' proposals the gate's mean survivals average over


class SurvivalAverage:
    """Per position, the mean prefix survival the gate weighs: each proposal's batch mean
    (read one proposal late, :class:`StalePerRequest`) joins a running average with weight
    R / (R + SURVIVAL_MEMORY), so that one small proposal's doubtful passage cannot close the
    gate for good; a batch of hundreds is its own average."""

    def __init__(self):
        self.mean: list[float] | None = None
        self.records_read = 0

    def update(self, stale: StalePerRequest, num_reqs: int) -> list[float]:
        """The average after taking in the newest readable record (the stale record's
        initial value until there is one)."""
        if stale.proposals >= 2 and stale.proposals != self.records_read:
            self.records_read = stale.proposals
            latest = stale.per_request()
            if self.mean is None:
                self.mean = list(latest)
            else:
                weight = num_reqs / (num_reqs + SURVIVAL_MEMORY)
                self.mean = [m + weight * (x - m) for m, x in zip(self.mean, latest, strict=True)]
        return stale.per_request() if self.mean is None else self.mean


class SlowestRequest:
    """``gate_objective=batch``: the prefix survivals of the request that drafts worst over
    its life so far. Per request slot, the sum and count of its proposals' survivals since
    the request started; a proposal's reading is the mean so far of the request whose mean
    expects the fewest accepted drafts (each step's own minimum would read whichever request
    has a bad passage, far below what the slowest request realises)."""

    def __init__(self, max_num_reqs: int, num_drafts: int, device: torch.device):
        self.sums = torch.zeros(max_num_reqs, num_drafts, device=device)
        self.counts = torch.zeros(max_num_reqs, device=device)
        self.owners: list[str | None] = [None] * max_num_reqs  # request id per slot
        self._fresh: torch.Tensor | None = None

    def start(self, req_ids: list[str], slots: np.ndarray) -> None:
        """Before a proposal, on the host: the batch rows whose slot a new request took."""
        fresh = []
        for slot, req_id in zip(slots.tolist(), req_ids, strict=True):
            fresh.append(self.owners[slot] != req_id)
            self.owners[slot] = req_id
        self._fresh = None
        if any(fresh):
            rows = torch.tensor(fresh, dtype=torch.bool)
            if self.sums.is_cuda:  # an asynchronous copy: no host sync
                rows = rows.pin_memory()
            self._fresh = rows.to(self.sums.device, non_blocking=True)

    def reading(self, slots: torch.Tensor, survival: torch.Tensor) -> torch.Tensor:
        """[K]: takes in a proposal's [R, K] survivals (positions not computed count 0) for
        the requests in ``slots``; the mean so far of the one expecting the fewest accepted
        drafts. On the device, no host sync."""
        slots = slots.long()
        sums, counts = self.sums[slots], self.counts[slots]
        if self._fresh is not None:
            sums = torch.where(self._fresh[:, None], 0.0, sums)
            counts = torch.where(self._fresh, 0.0, counts)
        sums = sums + survival.clamp(min=0.0)
        counts = counts + 1.0
        self.sums[slots], self.counts[slots] = sums, counts
        means = sums / counts[:, None]
        return means[means.sum(dim=1).argmin()]


def draft_seconds_table(rows: list[tuple[int, float]], max_num_reqs: int) -> torch.Tensor:
    """Seconds per proposal for R = 0..max_num_reqs from [(R, ms)] of the captured draft
    graphs: linear between them, held below the first, and growing in proportion to R
    beyond the last (larger batches draft eagerly, at least as slowly per request)."""
    reqs, ms = (np.array(column, dtype=np.float64) for column in zip(*sorted(rows), strict=True))
    batch = np.arange(max_num_reqs + 1, dtype=np.float64)
    seconds = np.interp(batch, reqs, ms) / 1000.0
    beyond = batch > reqs[-1]
    seconds[beyond] = ms[-1] / 1000.0 * batch[beyond] / reqs[-1]
    return torch.from_numpy(seconds)


def proposal_seconds(tables: dict[int, torch.Tensor], num_reqs: int, depth: int) -> float:
    """D(R) of a proposal computing ``depth`` positions, from {depth: seconds per proposal
    at R requests} of the depths whose graphs were timed: the shallowest timed depth that
    computes as many (the deepest if none does)."""
    timed = sorted(tables)
    chosen = next((d for d in timed if d >= depth), timed[-1])
    return float(tables[chosen][num_reqs])


@dataclass
class DraftGate:
    sps_table: torch.Tensor  # steps per second at T tokens per step, T = 0..R_max (1 + K)
    # {depth: seconds per proposal at R requests}, the depths whose graphs were timed
    draft_seconds: dict[int, torch.Tensor]
    # Masked verification (dspark_varlen_verify=false): the K drafts every speculative
    # step runs through the target, whatever it verifies (a skipped proposal's
    # placeholders too); 0 when steps are compacted to what they verify.
    masked_step_drafts: int = 0
    # Proposals each probe of the closed gate drafts in a row (PLAIN_PROBE_BURST with plain
    # steps) and what is left of the current one.
    probe_burst: int = 1
    probe_left: int = 0
    drafting: bool = True
    skipped_in_a_row: int = 0
    # Whether the last decision drafted with a margin no plain step could close: it beat a
    # plain step with no time outside the forward, R SPS(R), the fastest a plain step is.
    # Measuring plain steps (plain_steps.PlainCostProbe) can change nothing then.
    beats_any_plain_step: bool = False
    # The positions the coming proposal computes: the depth asked for, or a shallower one
    # that pays where that depth does not.
    depth_chosen: int = 0
    # The snapshot of survivals last valued by slot, and its rates by (requests, depth,
    # costs): the gate decides before every proposal, and both change far less often (a
    # snapshot while the gate's memory fills, costs once per fitted window).
    _rated_survival: torch.Tensor | None = field(default=None, repr=False)
    _rates: dict = field(default_factory=dict, repr=False)

    def gains(
        self,
        num_reqs: int,
        mean_survival: list[float],
        depth: int,
        overhead_s: float = 0.0,
        per_draft_s: float = 0.0,
        skip_s: float = 0.0,
        plain_s: float | None = None,
        survival: torch.Tensor | None = None,
        compaction_s: float = 0.0,
    ) -> tuple[float, float]:
        """(best expected tokens/s with drafting, tokens/s without: a plain step's when
        ``plain_s`` is given, else a speculative step's after a skipped proposal).
        ``survival``: a recent proposal's [R', K] survivals (R' >= SURVIVAL_MEMORY), which
        value drafting as ``sps`` admits, by slot (:meth:`_admission_rate`).
        ``compaction_s``: what a compacted step costs beyond vLLM's own, paid by every
        step verifying fewer than all K drafts a request (none after a skipped proposal)."""
        if plain_s is None:  # a speculative step verifying nothing, compacted
            without_s = self._forward_seconds(num_reqs, 0) + overhead_s + skip_s + compaction_s
            without = num_reqs / without_s
        else:  # a plain decode step: R tokens, compacted or not
            without = num_reqs / (1.0 / float(self.sps_table[num_reqs]) + plain_s)
        fixed = proposal_seconds(self.draft_seconds, num_reqs, depth) + overhead_s
        if survival is not None:
            rate = self._admission_rate(survival, num_reqs, depth, fixed, per_draft_s, compaction_s)
            return rate, without
        best, expected = 0.0, 1.0
        for j in range(1, depth + 1):
            expected += max(0.0, mean_survival[j - 1])
            step = self._forward_seconds(num_reqs, j) + fixed + per_draft_s * num_reqs * j
            step += compaction_s if j < len(mean_survival) else 0.0
            best = max(best, num_reqs * expected / step)
        return best, without

    def _admission_rate(
        self,
        survival: torch.Tensor,
        num_reqs: int,
        depth: int,
        fixed_s: float,
        per_draft_s: float,
        compaction_s: float,
    ) -> float:
        """Expected tokens/s of a step of ``num_reqs`` requests drafting ``depth`` positions
        whose survivals are like ``survival``'s rows (taken in turn), verifying the best
        slots as ``sps`` would; kept per snapshot, as sorting R K values before every
        proposal is host time on every step."""
        if survival is not self._rated_survival:
            self._rated_survival, self._rates = survival, {}
        key = (num_reqs, depth, fixed_s, per_draft_s, compaction_s)
        if key not in self._rates:
            rows = survival[torch.arange(num_reqs) % survival.shape[0]].double()
            table = masked_forward_table(self.sps_table, num_reqs, self.masked_step_drafts)
            depths = torch.tensor([depth])
            rate = best_rates_by_depth(rows, depths, table, fixed_s, per_draft_s, compaction_s)
            self._rates[key] = float(rate)
        return self._rates[key]

    def _forward_seconds(self, num_reqs: int, drafts_per_req: int) -> float:
        """The target's forward for a speculative step verifying ``drafts_per_req`` drafts
        per request (all K when masked)."""
        tokens = num_reqs * (1 + (self.masked_step_drafts or drafts_per_req))
        return 1.0 / float(self.sps_table[tokens])

    def decide(self, num_reqs: int, mean_survival: list[float], depth: int, **costs) -> bool:
        """Whether the coming proposal drafts (``costs``: the step costs :meth:`gains`
        takes), and at which depth (``depth_chosen``): the one asked for, or, where that
        does not pay, the shallower one whose graphs were timed (dynamic depth) that pays
        most. Only then: the gains weigh one depth for every request, where sps admits the
        likeliest drafts of each, deep ones included, so a shallower depth that merely
        weighs better could verify less than the one planned."""
        self.depth_chosen = depth
        if num_reqs == 0:
            return self.drafting
        best, without = self.gains(num_reqs, mean_survival, depth, **costs)
        margin = 1 - HYSTERESIS if self.drafting else 1 + HYSTERESIS
        self.drafting = best >= without * margin
        shallower = [d for d in self.draft_seconds if d < depth]
        if not self.drafting and shallower:
            rates = {d: self.gains(num_reqs, mean_survival, d, **costs)[0] for d in shallower}
            chosen = max(rates, key=rates.get)
            if rates[chosen] >= without * margin:
                self.drafting, self.depth_chosen, best = True, chosen, rates[chosen]
        fastest_plain = num_reqs * float(self.sps_table[num_reqs])
        self.beats_any_plain_step = best >= fastest_plain * (1 + HYSTERESIS)
        if self.drafting:
            self.skipped_in_a_row = self.probe_left = 0
            return True
        if self.probe_left:
            self.probe_left -= 1
            return True  # the probe's burst goes on
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= PROBE_EVERY:
            self.skipped_in_a_row, self.probe_left = 0, self.probe_burst - 1
            return True  # a probe: the gate stays closed unless its survivals reopen it
        return False
