"""How many sequential draft positions the drafter computes: load-aware physical depth.

With ``dspark_dynamic_depth`` the DSpark drafter computes only the first d of its K
positions after the parallel backbone (draft LM head over R*d rows, d Markov steps, the
confidence head); positions d..K-1 get a survival below every computed one, so capacity
control never admits them. A step vLLM verifies uncompacted verifies them anyway as a
point mass on the last drafted token, which keeps verification exact.

Once per window d follows a reading: with ``sps`` and draft graphs timed per depth, the
depth of most expected tokens per second over about a window's proposals' survivals
(:func:`~vllm_dspark.capacity.allocation.best_rates_by_depth`); otherwise the largest
per-request admission of the window's compacted steps. d drops to the larger reading of the
last two windows, probes one deeper after two windows that reached it, and returns to K when
the batch halves. Every tensor-parallel rank computes the same d from the same host values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Steps per window.
WINDOW_STEPS = 8
# Saturated windows in a row before probing one position deeper.
PROBE_AFTER = 2


@dataclass
class PhysicalDepth:
    max_depth: int
    depth: int = field(init=False)
    changes: int = field(default=0, init=False)
    _window_max: int = field(default=0, init=False)
    _previous_reading: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)
    _saturated: int = field(default=0, init=False)
    _reqs_at_change: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.depth = self.max_depth

    def _set(self, depth: int, num_reqs: int) -> None:
        if depth != self.depth:
            self.depth = depth
            self.changes += 1
            self._reqs_at_change = num_reqs

    def observe(
        self, num_reqs: int, max_admitted: int, cost_reading: Callable[[], int | None] | None = None
    ) -> int:
        """One compacted step: its batch size and the largest admission of a step already
        verified; ``cost_reading``, called at a window's end: the depth that pays best
        (None: not known, the largest admission counts). Returns the depth for the next
        proposal."""
        if self.depth < self.max_depth and num_reqs * 2 < self._reqs_at_change:
            self._set(self.max_depth, num_reqs)
            self._window_max = self._previous_reading = self._steps = self._saturated = 0
            return self.depth
        self._window_max = max(self._window_max, max_admitted)
        self._steps += 1
        if self._steps < WINDOW_STEPS:
            return self.depth
        reading = cost_reading() if cost_reading is not None else None
        if reading is None:
            reading = self._window_max
        saturated = reading >= self.depth
        self._saturated = self._saturated + 1 if saturated else 0
        if self._saturated >= PROBE_AFTER:
            self._set(min(self.depth + 1, self.max_depth), num_reqs)
            self._saturated = 0
        elif not saturated:
            recent = max(reading, self._previous_reading)
            self._set(max(1, min(self.depth, recent)), num_reqs)
        self._previous_reading, self._window_max, self._steps = reading, 0, 0
        return self.depth
