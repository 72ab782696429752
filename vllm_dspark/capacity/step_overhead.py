"""The part of a speculative step's time that the SPS curve does not see.

``sps`` weighs expected tokens against the step's time. The curve SPS(T) times the
target's forward alone (CUDA-graph replays); a real step also schedules, prepares inputs,
samples, rejects and hands its output back, on the host and the GPU. Leaving that out
makes each verified draft look dearer than it is: on the H200 the Qwen3-8B shape's step
at 256 requests took 11.0 ms against 8.98 ms on the curve, and the embedded pair's steps
(a tiny model, host-bound) took ~2.8 ms against a forward of a fraction of that, where
``sps`` then admitted nothing. Part of that time is paid per step whatever is verified
(O), part grows with the drafts verified (the rejection sampler and the output handling
work per token: b per draft). A step verifying n drafts for R requests then takes

    1 / SPS(R + n) + D(R) + O + b n,

D(R) being the drafter's profiled time per proposal, and ``sps`` maximises
(R + sum of the n best survivals) over that.

``auto`` fits O and b while serving. Each real proposal ends one step, whose host period
(the time since the previous proposal) is the step's cost in steady state, whether the
GPU or the host is the bottleneck; less the curve's forward for the tokens it verified and
D(R) when a proposal was drafted, that is one sample of O + b n. Each window's samples,
less those far above its median (a pause or a prefill step in between), join decayed
least-squares sums over the last few windows, from which O and b are fitted (a small ridge
keeps b at 0 where n never varied; both clamped at 0). An admission that settles stays
the same step after step, which cannot tell b from O, so capacity control verifies half
of it now and then (``control.EXPLORE_EVERY``). The host clock differs between
tensor-parallel ranks, so each window's (O, b) is reduced to the largest over ranks on
the device and read one window later (its copy long done): every rank plans with the same
values, as the admission must be identical on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

WINDOW = 32  # proposals per fit
OUTLIER = 3.0  # samples above this many times the window's median are left out
DECAY = 0.8  # per window: the fit weighs about the last five windows
RIDGE = 1.0  # draft-count variance added to the fit's denominator (in drafts squared)


class OverheadFit:
    """Decayed least-squares sums of (drafts n, residual r) for r = O + b n."""

    def __init__(self):
        self.sums = np.zeros(5)  # count, n, r, n^2, n r

    def add(self, drafts: np.ndarray, residuals: np.ndarray) -> None:
        """One window's samples, less its outliers; earlier windows decay."""
        keep = residuals <= OUTLIER * np.median(residuals) + 1e-6
        n, r = drafts[keep], residuals[keep]
        window = np.array([len(n), n.sum(), r.sum(), (n * n).sum(), (n * r).sum()])
        self.sums = DECAY * self.sums + window

    def estimate(self) -> tuple[float, float]:
        """(O, b), both >= 0."""
        count, n, r, nn, nr = self.sums
        mean_n, mean_r = n / count, r / count
        slope = max(0.0, (nr - count * mean_n * mean_r) / (nn - count * mean_n**2 + RIDGE))
        return max(0.0, mean_r - slope * mean_n), slope


class StepOverhead:
    def __init__(
        self,
        device: torch.device,
        fixed_seconds: float | None = None,
        reduce_max: Callable[[torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``fixed_seconds``: a given O (b = 0, no measurement). ``reduce_max``: in-place
        max over tensor-parallel ranks of a device tensor (None: one rank)."""
        self.seconds = fixed_seconds or 0.0  # O
        self.per_draft_seconds = 0.0  # b
        self.measuring = fixed_seconds is None
        self.ready = not self.measuring  # whether O and b hold a fit (or were given)
        self._reduce_max = reduce_max
        self._clock = clock
        self._samples: list[tuple[int, float]] = []
        self._fit = OverheadFit()
        self._last_time: float | None = None
        cuda = device.type == "cuda"
        self._device_value = torch.zeros(2, dtype=torch.float64, device=device)
        self._host_value = torch.zeros(2, dtype=torch.float64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._pending = False

    def observe(self, verified_drafts: int | None, forward_s: float, draft_s: float) -> None:
        """At a real proposal: the step that just ran verified ``verified_drafts`` drafts
        (None: not a decode step the curve describes), its forward on the curve took
        ``forward_s`` and the proposal before it ``draft_s`` (0 when skipped)."""
        if not self.measuring:
            return
        now = self._clock()
        last, self._last_time = self._last_time, now
        if last is None or verified_drafts is None:
            return
        self._samples.append((verified_drafts, max(0.0, now - last - forward_s - draft_s)))
        if len(self._samples) < WINDOW:
            return
        samples = np.array(self._samples, dtype=np.float64)
        self._fit.add(samples[:, 0], samples[:, 1])
        self._publish(self._fit.estimate())
        self._samples.clear()

    def _publish(self, fitted: tuple[float, float]) -> None:
        # The previous window's reduced values (their event long done) become the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            self.seconds, self.per_draft_seconds = self._host_value.tolist()
            self.ready = True
        for value, target in zip(fitted, self._device_value, strict=True):
            target.fill_(value)  # a kernel argument: no copy from pageable memory
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
