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
D(R) when a proposal was drafted, that is one sample of O + b n. Every window of samples
is fitted by least squares (samples far above the median, a pause or a prefill step
in between, left out; a small ridge keeps b at 0 where n never varied), both clamped at
0 (capacity control varies a saturated admission now and then so that b can be told
apart from O). The host clock differs between tensor-parallel ranks, so each window's (O, b) is
reduced to the largest over ranks on the device and read one window later (its copy long
done): every rank plans with the same values, as the admission must be identical on
every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

WINDOW = 32  # proposals per fit
OUTLIER = 3.0  # samples above this many times the window's median are left out
RIDGE = 1.0  # draft-count variance added to the fit's denominator (in drafts squared)


def fit_overhead(drafts: np.ndarray, residuals: np.ndarray) -> tuple[float, float]:
    """(O, b) of residual = O + b * drafts, least squares without outliers, both >= 0."""
    keep = residuals <= OUTLIER * np.median(residuals) + 1e-6
    drafts, residuals = drafts[keep], residuals[keep]
    centered = drafts - drafts.mean()
    slope = float((centered * (residuals - residuals.mean())).sum())
    slope /= float((centered**2).sum()) + RIDGE
    slope = max(0.0, slope)
    return max(0.0, float(residuals.mean()) - slope * float(drafts.mean())), slope


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
        self._reduce_max = reduce_max
        self._clock = clock
        self._samples: list[tuple[int, float]] = []
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
        self._publish(fit_overhead(samples[:, 0], samples[:, 1]))
        self._samples.clear()

    def _publish(self, fitted: tuple[float, float]) -> None:
        # The previous window's reduced values (their event long done) become the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            self.seconds, self.per_draft_seconds = self._host_value.tolist()
        for value, target in zip(fitted, self._device_value, strict=True):
            target.fill_(value)  # a kernel argument: no copy from pageable memory
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
