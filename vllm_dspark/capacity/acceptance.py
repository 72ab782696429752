"""Verified depth from recent acceptance, for drafters without a confidence head.

``dspark_capacity=acceptance`` (DFlash, or DSpark without a confidence head) verifies the
same number d of leading drafts for every request of a decode step. d follows the mean
number of drafts the verified requests accepted: after each window of steps, the target
is clamp(floor(mean accepted + 1.5), 1, K); d drops to a lower target at once and climbs
toward a higher one by one per window. The mean is of steps already verified (read one
step late, :mod:`vllm_dspark.capacity.stale_record`), so d never depends on the drafts it
is applied to, and speculative sampling stays lossless. While d < K a request can accept
at most d drafts, so a mean near d means d is what limits acceptance: the + 1.5 margin
lets d climb out of that.

Host-side integer arithmetic on values every rank reads alike: every tensor-parallel
rank picks the same d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Steps per window.
WINDOW_STEPS = 8
# Drafts beyond the mean accepted that the target keeps verifying.
MARGIN = 1.5


@dataclass
class AcceptanceDepth:
    max_depth: int
    depth: int = field(init=False)
    _sum: float = field(default=0.0, init=False)
    _steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.depth = self.max_depth

    def target(self, mean_accepted: float) -> int:
        return max(1, min(self.max_depth, math.floor(mean_accepted + MARGIN)))

    def observe(self, mean_accepted: float) -> int:
        """One step's mean accepted drafts per verified request; returns the new depth."""
        self._sum += mean_accepted
        self._steps += 1
        if self._steps == WINDOW_STEPS:
            target = self.target(self._sum / WINDOW_STEPS)
            self.depth = target if target < self.depth else min(self.depth + 1, target)
            self._sum, self._steps = 0.0, 0
        return self.depth
