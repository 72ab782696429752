"""The part of a speculative step's time that the SPS curve does not see.

The SPS curve times the target's forward alone, on dummy requests that attend only their
own query tokens; a real step also schedules, prepares inputs, reads each request's context
K/V, samples, rejects and hands its output back. Left out, that makes each verified draft
look dearer than it is. A step verifying n drafts for R decoding requests is modelled as

    1 / SPS(R + n) + D(R) + O + a R + b n + C [n < R K],

D(R) the drafter's profiled time per proposal, O + a R paid per step (a grows with the
requests' context), b per verified draft, C what compacting costs over vLLM's own uniform
step. A skipped proposal still costs S (context K/V stored, speculative path run); a plain
decode step (:mod:`plain_steps`) costs P + p R, fitted apart and held at most O + a R + S.

``auto`` fits these while serving. Each step's period runs from the previous proposal's
start to its own, as the device's stream runs them (:class:`DevicePeriods`): the host runs
a step or more ahead under async scheduling, so its own clock would time an earlier step.
Less the curve's forward (at all the step's tokens: a served step's prompts too) and D, a
period is one sample; windows of samples (outliers dropped) join decayed, lightly ridged
least squares. Steps that carry prompts are samples too: under load they are most steps,
and the context K/V their requests read (a R) is much of what speculation saves. Each
window's values are reduced to the largest over tensor-parallel ranks and read a window
later, so every rank plans the same admission. Measurements behind this model:
``docs/design/module-notes.md``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

WINDOW = 32  # steps marked per fit
OUTLIER = 3.0  # samples above this many times the window's median are left out
DECAY = 0.8  # per window: the fit weighs about the last five windows
# Added to each slope's diagonal, relative to it: a slope stays 0 where its variable never
# varied (or was always 0), and a rare variable (few skipped proposals) is not shrunk.
RIDGE = 1e-5
# Periods a device stream may run behind the host before the oldest are forgotten.
PERIOD_SLOTS = 64


class OverheadFit:
    """Decayed least-squares sums for r = O + a R + b n + S z + C c (R requests, n drafts
    verified, z = 1 after a skipped proposal, c = 1 in a compacted step)."""

    def __init__(self):
        self.gram = np.zeros((5, 5))  # sum of x x^T, x = (1, R, n, z, c)
        self.moment = np.zeros(5)  # sum of x r

    def add(
        self,
        requests: np.ndarray,
        drafts: np.ndarray,
        residuals: np.ndarray,
        skipped: np.ndarray | None = None,
        compacted: np.ndarray | None = None,
    ) -> None:
        """One window's samples, less its outliers; earlier windows decay."""
        keep = residuals <= OUTLIER * np.median(residuals) + 1e-6
        zeros = np.zeros_like(residuals)
        skipped = zeros if skipped is None else skipped
        compacted = zeros if compacted is None else compacted
        columns = [np.ones(len(residuals)), requests, drafts, skipped, compacted]
        x = np.stack([column[keep] for column in columns], axis=1)
        self.gram = DECAY * self.gram + x.T @ x
        self.moment = DECAY * self.moment + x.T @ residuals[keep]

    def estimate(self) -> tuple[float, float, float, float, float]:
        """(O, a, b, S, C), all >= 0: a slope the data make negative is left out and the
        rest refitted."""
        slopes = [1, 2, 3, 4]
        while True:
            terms = [0, *slopes]
            ridge = [RIDGE * self.gram[term, term] + 1e-30 for term in slopes]
            gram = self.gram[np.ix_(terms, terms)] + np.diag([0.0, *ridge])
            fitted = np.linalg.solve(gram, self.moment[terms])
            negative = [term for term, value in zip(slopes, fitted[1:], strict=True) if value < 0]
            if not negative:
                break
            slopes = [term for term in slopes if term not in negative]
        values = np.zeros(5)
        values[terms] = fitted
        return max(0.0, float(values[0])), *(float(value) for value in values[1:])


class DevicePeriods:
    """Periods between consecutive marks as the current device stream reaches them: each
    mark records a CUDA event, and a period is read once its ending event is done (queried,
    never waited for), with the payload of the mark that ends it."""

    def __init__(self, slots: int = PERIOD_SLOTS):
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(slots)]
        self._next = 0
        self._pending: deque[tuple[torch.cuda.Event, Any]] = deque()  # oldest first
        self._last: torch.cuda.Event | None = None  # the latest done mark

    def mark(self, payload: Any) -> list[tuple[float, Any]]:
        """Record a mark; returns (seconds, payload) of each period done since the last
        call, oldest first. A None payload marks a start only."""
        if len(self._pending) >= len(self._events) - 2:
            # The stream runs far behind: forget the marks before this one rather than
            # record over an event a period still needs.
            self._pending.clear()
            self._last = None
        event = self._events[self._next]
        self._next = (self._next + 1) % len(self._events)
        event.record()
        self._pending.append((event, payload))
        periods = []
        while self._pending and self._pending[0][0].query():
            done, ending = self._pending.popleft()
            if self._last is not None and ending is not None:
                periods.append((self._last.elapsed_time(done) / 1e3, ending))
            self._last = done
        return periods


class HostPeriods:
    """:class:`DevicePeriods` on a host clock, each period returned at once (a CPU device,
    and tests with a fake clock)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._last: float | None = None

    def mark(self, payload: Any) -> list[tuple[float, Any]]:
        now = self._clock()
        last, self._last = self._last, now
        return [] if last is None or payload is None else [(now - last, payload)]


class StepOverhead:
    def __init__(
        self,
        device: torch.device,
        fixed_seconds: float | None = None,
        reduce_max: Callable[[torch.Tensor], None] | None = None,
        periods: DevicePeriods | HostPeriods | None = None,
    ):
        """``fixed_seconds``: a given O (a = b = 0, no measurement). ``reduce_max``:
        in-place max over tensor-parallel ranks of a device tensor (None: one rank).
        ``periods``: what times the steps (by default the device's stream)."""
        self.seconds = fixed_seconds or 0.0  # O
        self.per_request_seconds = 0.0  # a
        self.per_draft_seconds = 0.0  # b
        self.skip_seconds = 0.0  # S
        self.compaction_seconds = 0.0  # C
        self.measuring = fixed_seconds is None
        self.ready = not self.measuring  # whether O and b hold a fit (or were given)
        self._reduce_max = reduce_max
        cuda = device.type == "cuda"
        if periods is None:
            periods = DevicePeriods() if cuda and self.measuring else HostPeriods()
        self._periods = periods
        # (R, n, residual, skipped, compacted, plain) per step
        self._samples: list[tuple[int, int, float, bool, bool, bool]] = []
        self._fit = OverheadFit()
        self._plain_fit = OverheadFit()  # (1, R) columns only: P + p R
        self.plain_seconds = 0.0  # P, 0 until plain steps were measured
        self.plain_per_request_seconds = 0.0  # p
        self._marked = 0  # steps marked that the fit describes (their periods read or not)
        self._device_value = torch.zeros(8, dtype=torch.float64, device=device)
        self._host_value = torch.zeros(8, dtype=torch.float64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._pending = False

    def per_step_seconds(self, num_reqs: int) -> float:
        """O + a R: the step's time outside the curve before any draft is verified."""
        return self.seconds + self.per_request_seconds * num_reqs

    def verification_costs(self, num_reqs: int) -> tuple[float, float, float]:
        """(O + a R, b, C) as fitted (or given) for a step of ``num_reqs`` requests: what
        sps and the depth choices add to the curve's forward; zeros until the first fit."""
        if not self.ready:
            return 0.0, 0.0, 0.0
        return self.per_step_seconds(num_reqs), self.per_draft_seconds, self.compaction_seconds

    def plain_step_seconds(self, num_reqs: int) -> float | None:
        """P + p R: a plain decode step's time outside the curve (None: not measured), at
        most O + a R + S + C, a speculative step's after a skipped proposal (compacted to
        no draft)."""
        if self.plain_seconds <= 0.0:
            return None
        plain = self.plain_seconds + self.plain_per_request_seconds * num_reqs
        after_skip = self.per_step_seconds(num_reqs) + self.skip_seconds + self.compaction_seconds
        return min(plain, after_skip)

    def observe(
        self,
        verified_drafts: int | None,
        forward_s: float,
        draft_s: float,
        num_reqs: int = 0,
        skipped: bool = False,
        plain: bool = False,
        compacted: bool = False,
    ) -> None:
        """At a real proposal: the step that just ran, for ``num_reqs`` decoding requests,
        verified ``verified_drafts`` drafts (None: not a step the curve describes), its
        forward on the curve takes ``forward_s`` and the proposal before it ``draft_s`` (0
        when ``skipped``); ``plain``: it was a plain decode step; ``compacted``: its batch
        was compacted."""
        if not self.measuring:
            return
        step = None
        if verified_drafts is not None:
            step = (num_reqs, verified_drafts, forward_s + draft_s, skipped, compacted, plain)
            self._marked += 1
        for period, (requests, drafts, explained, *kinds) in self._periods.mark(step):
            self._samples.append((requests, drafts, max(0.0, period - explained), *kinds))
        if step is not None and self._marked % WINDOW == 0:
            self._fit_window()

    def _fit_window(self) -> None:
        """Every ``WINDOW`` steps marked (the same steps on every rank, however many of
        their periods each rank has read): the samples read join the fits, which are
        published."""
        if self._samples:
            samples = np.array(self._samples, dtype=np.float64)
            plain_rows = samples[:, 5] > 0
            speculative = samples[~plain_rows]
            if len(speculative):
                self._fit.add(*speculative[:, :5].T)
            if plain_rows.any():
                plain_samples = samples[plain_rows]
                zeros = np.zeros(len(plain_samples))
                self._plain_fit.add(plain_samples[:, 0], zeros, plain_samples[:, 2], zeros)
            self._samples.clear()
        # Until a speculative step was read (on some rank) there is nothing to plan with.
        fitted = self._fit.gram[0, 0] > 0
        values = self._fit.estimate() if fitted else (0.0,) * 5
        plain = self._plain_fit.estimate()[:2] if self._plain_fit.gram[0, 0] > 0 else (0.0, 0.0)
        self._publish((*values, *plain, float(fitted)))

    def _publish(self, fitted: tuple[float, ...]) -> None:
        """(O, a, b, S, C, P, p, whether fitted) of this window, reduced over ranks and
        read a window later."""
        # The previous window's reduced values (their event long done) become the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            values = self._host_value.tolist()
            if values[7] > 0:
                self.seconds, self.per_request_seconds, self.per_draft_seconds = values[:3]
                self.skip_seconds, self.compaction_seconds = values[3:5]
                self.plain_seconds, self.plain_per_request_seconds = values[5:7]
                self.ready = True
        for value, target in zip(fitted, self._device_value, strict=True):
            target.fill_(value)  # a kernel argument: no copy from pageable memory
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
