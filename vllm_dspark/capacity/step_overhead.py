"""The part of a speculative step's time that the SPS curve does not see.

``sps`` weighs expected tokens against the step's time. The curve SPS(T) times the
target's forward alone (CUDA-graph replays); a real step also schedules, prepares inputs,
samples, rejects and hands its output back, on the host and the GPU. That overhead O is
paid whatever is admitted, so leaving it out makes each verified draft look dearer than
it is: on the H200 the Qwen3-8B shape's step at 256 requests took 11.0 ms against 8.98 ms
on the curve, and the embedded pair's steps (a tiny model, host-bound) took ~2.8 ms
against a forward of a fraction of that, where ``sps`` then admitted nothing. With O the
objective becomes (R + sum of admitted survivals) / (1 / SPS(R + n) + D(R) + O), with
D(R) the drafter's profiled time per proposal.

``auto`` measures O while serving: each real proposal ends one step, whose host period
(the time since the previous proposal) is the step's cost in steady state, whether the
GPU or the host is the bottleneck; less the curve's forward for the tokens it verified
and D(R) when the step drafted, that is one sample of O. The median of a window of
samples is the estimate. The host clock differs between tensor-parallel ranks, so each
window's median is reduced to the largest over ranks on the device and read one window
later (its copy long done): every rank plans with the same value, as the admission must
be identical on every rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

WINDOW = 32  # proposals per estimate


class StepOverhead:
    def __init__(
        self,
        device: torch.device,
        fixed_seconds: float | None = None,
        reduce_max: Callable[[torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``fixed_seconds``: a given O (no measurement). ``reduce_max``: in-place max over
        tensor-parallel ranks of a device tensor (None: one rank)."""
        self.seconds = fixed_seconds or 0.0
        self._measuring = fixed_seconds is None
        self._reduce_max = reduce_max
        self._clock = clock
        self._samples: list[float] = []
        self._last_time: float | None = None
        cuda = device.type == "cuda"
        self._device_value = torch.zeros(1, dtype=torch.float64, device=device)
        self._host_value = torch.zeros(1, dtype=torch.float64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._pending = False

    def observe(self, step_tokens: int | None, forward_s: float, draft_s: float) -> None:
        """At a real proposal: the step that just ran verified ``step_tokens`` tokens
        (None: not a decode step the curve describes), whose forward the curve puts at
        ``forward_s`` and whose proposal before it took ``draft_s`` (0 when skipped)."""
        if not self._measuring:
            return
        now = self._clock()
        last, self._last_time = self._last_time, now
        if last is None or step_tokens is None:
            return
        self._samples.append(max(0.0, now - last - forward_s - draft_s))
        if len(self._samples) < WINDOW:
            return
        self._publish(statistics.median(self._samples))
        self._samples.clear()

    def _publish(self, median: float) -> None:
        # The previous window's reduced value (its event long done) becomes the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            self.seconds = float(self._host_value[0])
        self._device_value.fill_(median)
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
