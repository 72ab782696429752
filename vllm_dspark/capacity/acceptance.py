"""Verified depth from recent acceptance, for drafters without a confidence head.

``dspark_capacity=acceptance`` (DFlash, or DSpark without a confidence head) verifies the
same number d of leading drafts for every request of a decode step.

It learns, per draft position j, decayed counts of verifications that reached j and of
those that accepted it; their ratio a_j is j's acceptance given the ones before, and the
survival S_j = a_1 ... a_j gives 1 + S_1 + ... + S_d tokens a request gains at depth d. (A
rule on the mean accepted length would be censored: at depth d nobody accepts more than d.)
A position not verified lately keeps its last ratio; one without counts takes its
predecessor's (1 at first, so the controller starts at K).

With the target's SPS curve, d maximises expected tokens per second at the step's R requests,

    R (1 + S_1 + ... + S_d) / (1 / SPS(R (1 + d)) + D_d(R) + O + a R + b R d + C [d < K]),

with the step's costs of :mod:`step_overhead` and D_d(R) the proposal's profiled time;
without a curve, d = clamp(floor(S_1 + ... + S_K + 1.5), 1, K). d drops at once, climbs at
once back to a depth verified within ``RECENT_STEPS``, and past that one per
``WINDOW_STEPS``. The counts are of steps already verified (read one step late,
:mod:`stale_record`), so d never depends on the drafts it is applied to and sampling stays
lossless; every tensor-parallel rank picks the same d.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

WINDOW_STEPS = 8  # steps between two climbs of one
RECENT_STEPS = 64  # steps a verified depth stays one to climb back to at once (as DECAY)
DECAY = 1 - 1 / 64  # per step: the counts weigh about the last 64 steps
MARGIN = 1.5  # drafts beyond the expected accepted length that the length rule verifies
MIN_REACHED = 1e-3  # fewer (decayed) verifications reaching a position: no ratio of its own


def position_counts(num_verified: torch.Tensor, num_accepted: torch.Tensor, max_depth: int):
    """Per position j = 1..K of one verified step: (verifications that reached j,
    of those, the ones that accepted j), from each request's drafts verified and
    accepted (a request that verified none counts nowhere)."""
    positions = torch.arange(1, max_depth + 1, device=num_verified.device)
    verified, accepted = num_verified[:, None], num_accepted[:, None]
    reached = (verified >= positions) & (accepted >= positions - 1)
    return reached.sum(dim=0), (accepted >= positions).sum(dim=0)


def best_depth(
    survival: np.ndarray,
    num_reqs: int,
    sps_table: torch.Tensor,
    fixed_s: float = 0.0,
    per_draft_s: float = 0.0,
    draft_s: np.ndarray | float = 0.0,
    masked_step_drafts: int = 0,
    compaction_s: float = 0.0,
) -> int:
    """The d in 1..K of most expected tokens per second (the module's formula), ``fixed_s``
    being O + a R at this batch and ``draft_s`` D_1(R)..D_K(R) (or one time for all).
    ``masked_step_drafts`` (K with ``dspark_varlen_verify=false``, else 0): every depth's
    step runs that many drafts per request through the target. ``compaction_s``: what a
    compacted step (d < K) costs beyond vLLM's own (:mod:`step_overhead`'s C)."""
    depths = np.arange(1, len(survival) + 1)
    expected = 1.0 + np.cumsum(survival)
    tokens = np.minimum(num_reqs * (1 + (masked_step_drafts or depths)), len(sps_table) - 1)
    forward = 1.0 / sps_table.double().numpy()[tokens]
    step = forward + draft_s + fixed_s + per_draft_s * num_reqs * depths
    step = step + compaction_s * (depths < len(survival))
    return int(depths[np.argmax(expected / step)])


@dataclass
class AcceptanceDepth:
    max_depth: int
    depth: int = field(init=False)
    reached: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)
    changes: int = field(default=0, init=False)
    _since_climb: int = field(default=0, init=False)
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS), init=False)

    def __post_init__(self) -> None:
        self.depth = self.max_depth
        self.reached = np.zeros(self.max_depth)
        self.accepted = np.zeros(self.max_depth)

    def observe(self, reached: list[float], accepted: list[float]) -> None:
        """One verified step's counts per position (:func:`position_counts`)."""
        self.reached = DECAY * self.reached + np.asarray(reached)
        self.accepted = DECAY * self.accepted + np.asarray(accepted)

    def survival(self) -> np.ndarray:
        """S_1..S_K, positions without data taking their predecessor's ratio."""
        ratios, last = np.empty(self.max_depth), 1.0
        for j in range(self.max_depth):
            if self.reached[j] >= MIN_REACHED:
                last = self.accepted[j] / self.reached[j]
            ratios[j] = last
        return np.cumprod(ratios)

    def length_target(self) -> int:
        expected = float(self.survival().sum())
        return max(1, min(self.max_depth, math.floor(expected + MARGIN)))

    def update(self, target: int) -> int:
        """Once per step: drop to ``target`` at once; climb toward it at once up to the
        deepest depth of the last RECENT_STEPS steps, past that one position once a window
        has passed since the last climb. Returns the depth the next step verifies."""
        self._since_climb += 1
        recent = max(self._recent, default=0)
        if target < self.depth:
            self.depth = target
            self.changes += 1
        elif target > self.depth and recent > self.depth:
            self.depth = min(target, recent)
            self.changes += 1
            self._since_climb = 0
        elif target > self.depth and self._since_climb >= WINDOW_STEPS:
            self.depth += 1
            self.changes += 1
            self._since_climb = 0
        self._recent.append(self.depth)
        return self.depth
