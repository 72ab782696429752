"""The depth half of :class:`~vllm_dspark.capacity.controller.CapacityController`: how many
sequential positions a proposal computes (``dspark_dynamic_depth``: DSpark's confidence
modes follow recent admissions, :mod:`physical_depth`, at the depth that paid best on
recent proposals' survivals) and, for ``acceptance``, the one depth every request
verifies (:mod:`acceptance`). Its state is the controller's, set up in its ``__init__``."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dspark.capacity.acceptance import best_depth
from vllm_dspark.capacity.allocation import best_rates_by_depth, masked_forward_table

# acceptance: a varied step halves every request's depth, so it is taken only where the
# depth would differ with DRAFT_TIME_DOUBT more per verified draft than fitted (varied
# steps where b cannot matter only cost time).
DRAFT_TIME_DOUBT = 10e-6


class DepthControl:
    """The base of :class:`~vllm_dspark.capacity.controller.CapacityController`, whose
    ``__init__`` sets up the state read here."""

    def proposal_depth(self, num_reqs: int) -> int:
        """Before a real proposal: the positions it computes. With dynamic depth, DSpark's
        confidence modes follow recent admissions (:mod:`physical_depth`); acceptance plans
        here, once per step, the depth the next step verifies, and computes just that."""
        if not self.options.dynamic_depth:
            return self.num_speculative_steps
        if self.acceptance is not None:
            return self._acceptance_depth(num_reqs)
        return self.physical_depth.depth

    @property
    def depth_changes(self) -> int:
        """Changes of the depth drafted (dynamic depth) or verified (acceptance)."""
        controller = self.physical_depth or self.acceptance
        return controller.changes if controller is not None else 0

    def _acceptance_depth(self, num_reqs: int) -> int:
        """acceptance: the depth every request verifies, after taking in the newest
        verified step's counts."""
        self._observe_acceptance()
        target = self._best_acceptance_depth(num_reqs)
        if target is None:
            return self.acceptance.update(self.acceptance.length_target())
        return self.acceptance.update(target)

    def _best_acceptance_depth(self, num_reqs: int, doubt_s: float = 0.0) -> int | None:
        """The depth of most expected tokens per second on the curve at ``num_reqs``
        requests, each verified draft ``doubt_s`` dearer than fitted (None: no curve)."""
        if self.sps_table_host is None:
            return None
        fixed, per_draft, compaction = self.step_overhead.verification_costs(num_reqs)
        if self.options.dynamic_depth:  # a shallower proposal costs less
            depths = range(1, self.num_speculative_steps + 1)
            draft = np.array([self._proposal_seconds(num_reqs, d) for d in depths])
        else:
            draft = self._proposal_seconds(num_reqs, self.num_speculative_steps)
        return best_depth(
            self.acceptance.survival(),
            num_reqs,
            self.sps_table_host,
            fixed,
            per_draft + doubt_s,
            draft,
            masked_step_drafts=self.masked_step_drafts,
            compaction_s=compaction,
        )

    def _depth_hinges_on_draft_time(self, num_reqs: int) -> bool:
        """acceptance fitting its step overhead: whether the time per verified draft could
        change the depth at this load (DRAFT_TIME_DOUBT more than fitted would), the only
        place a varied step's reading is worth its lost drafts; until the overhead is
        fitted, always."""
        if not self.step_overhead.ready:
            return True
        plain = self._best_acceptance_depth(num_reqs)
        return plain != self._best_acceptance_depth(num_reqs, DRAFT_TIME_DOUBT)

    def _observe_acceptance(self) -> None:
        """acceptance: take in the newest verified step's counts per position, once."""
        counts = self.stale_position_counts
        if counts.proposals != self.position_counts_read:
            self.position_counts_read = counts.proposals
            totals, num_drafts = counts.per_request(), self.num_speculative_steps
            self.acceptance.observe(totals[:num_drafts], totals[num_drafts:])

    def _paying_depth(self) -> int | None:
        """sps with dynamic depth, at a window's end: the depth d' <= d whose proposals
        would have brought the most expected tokens per second, summed over the snapshots
        read since the last window's end (:meth:`_depth_rates`). None without any."""
        rates = self._depth_rates(list(self.depth_snapshots))
        self.depth_snapshots.clear()
        if rates is None:
            return None
        return int(np.argmax(rates[: self.physical_depth.depth])) + 1

    def _depth_rates(self, snapshots: list[torch.Tensor]) -> np.ndarray | None:
        """Per depth d' = 1..K, summed over proposals' survivals [R, K] (host snapshots):
        the best admission among the first d' positions by sps's objective with that
        depth's proposal time added, in expected tokens per second. One batched
        evaluation per batch size (a window at one request holds 8 proposals). None
        without snapshots, a curve or per-depth draft timings (the largest admission
        reads then)."""
        if not snapshots or self.sps_table_host is None or len(self.draft_tables) < 2:
            return None
        num_drafts = self.num_speculative_steps
        depths = torch.arange(1, num_drafts + 1)
        total = np.zeros(num_drafts)
        for num_reqs in sorted({len(s) for s in snapshots}):
            group = torch.stack([s for s in snapshots if len(s) == num_reqs]).double()
            fixed = per_draft = compaction = 0.0
            if self.step_overhead is not None:
                fixed, per_draft, compaction = self.step_overhead.verification_costs(num_reqs)
            draft = torch.tensor([self._proposal_seconds(num_reqs, int(d)) for d in depths])
            table = masked_forward_table(self.sps_table_host, num_reqs, self.masked_step_drafts)
            rates = best_rates_by_depth(group, depths, table, fixed + draft, per_draft, compaction)
            total += rates.sum(dim=0).numpy()
        return total
