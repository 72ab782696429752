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

d follows a reading taken once per window of steps:

- with ``sps`` and draft graphs timed per depth, the depth that pays best: on proposals'
  survivals of about the last window (read on the host two proposals late,
  :class:`~vllm_dspark.capacity.stale_record.StaleSnapshots`; one proposal per window at
  64 requests or more, every one at one request), for each depth d' <= d the best
  admission among the first d' positions by ``sps``'s own objective with that depth's
  proposal time added (:func:`~vllm_dspark.capacity.allocation.best_rates_by_depth`),
  summed over the snapshots, and the d' of most expected tokens per second. One proposal of one
  request is too noisy a reading: its drafts could look not worth a deep proposal where
  on average they are (at one request a deeper proposal costs about 0.05 ms a position).
  Where confidence varies between requests, some request almost always admits all K
  drafts, so the largest admission (below) keeps d at K although the positions past 3
  or 4 do not pay for their own drafting: on the Qwen3-8B shape at 256 requests,
  calibrated synthetic confidence of a trained head's spread, the control path in
  closed loop on the H200's step costs stayed at d = 7 for 1.09x a step without drafts;
  reading the depth that pays, it settles at 3 to 5 for 1.15x
  (``tests/cpu/test_dynamic_depth.py``, a CPU model, not a GPU measurement);
- otherwise (threshold, budget, or no per-depth timings) the largest per-request
  admission of the window's compacted steps (read one step late, :mod:`stale_record`):
  the drafts computed that nobody verified.

After each window:

- d drops to the larger reading of the last two windows (at least 1);
- a window whose reading reached d means d itself may be the limit: after two such
  windows in a row d probes one position deeper;
- a batch that shrank to under half the size it had when d last changed (load is
  leaving) puts d back to K at once.

Host-side decisions on values every rank reads alike (the admissions and the snapshots
come from identical survivals and budgets, and the reading is the same arithmetic on
the same host values): every tensor-parallel rank computes the same d.
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
