"""How many sequential draft positions the drafter computes: load-aware physical depth.

With ``dspark_dynamic_depth`` the DSpark drafter computes only the first d of its K
positions after the parallel backbone (the draft LM head over R*d rows, d steps of the
Markov loop, the confidence head); positions d..K-1 get a survival below every computed
one, so capacity control never admits them, and a step's budget never exceeds R*d. The
backbone keeps the checkpoint's block layout (K query tokens per request). A step vLLM
verifies uncompacted (prefills, logprobs, structured output in the batch) verifies them
anyway: they hold the last drafted token, recorded for probabilistic verification as
drawn from a point mass on it, which keeps it exact (any draft distribution does, if the
draft was really drawn from it).

d follows what capacity control actually admitted. Every compacted step records its
largest per-request admission (read one step late, :mod:`stale_record`). After each
window of steps:

- d drops to the largest admission seen over the last two windows (at least 1);
- a window whose largest admission reached d means d itself may be the limit: after
  two such windows in a row d probes one position deeper;
- a batch that shrank to under half the size it had when d last changed (load is
  leaving) puts d back to K at once.

Host-side integer decisions on values every rank reads alike (the admissions come from
identical survivals and budgets): every tensor-parallel rank computes the same d.
"""

from __future__ import annotations

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
    _previous_window_max: int = field(default=0, init=False)
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

    def observe(self, num_reqs: int, max_admitted: int) -> int:
        """One compacted step: its batch size and the largest admission of a step already
        verified. Returns the depth for the next proposal."""
        if self.depth < self.max_depth and num_reqs * 2 < self._reqs_at_change:
            self._set(self.max_depth, num_reqs)
            self._window_max = self._previous_window_max = self._steps = self._saturated = 0
            return self.depth
        self._window_max = max(self._window_max, max_admitted)
        self._steps += 1
        if self._steps < WINDOW_STEPS:
            return self.depth
        saturated = self._window_max >= self.depth
        self._saturated = self._saturated + 1 if saturated else 0
        if self._saturated >= PROBE_AFTER:
            self._set(min(self.depth + 1, self.max_depth), num_reqs)
            self._saturated = 0
        elif not saturated:
            recent = max(self._window_max, self._previous_window_max)
            self._set(max(1, min(self.depth, recent)), num_reqs)
        self._previous_window_max, self._window_max, self._steps = self._window_max, 0, 0
        return self.depth
