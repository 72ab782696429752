"""The part of a speculative step's time that the SPS curve does not see.

``sps`` weighs expected tokens against the step's time. The curve SPS(T) times the
target's forward alone (dummy decode steps); a real step also schedules, prepares inputs,
samples, rejects and hands its output back, on the host and the GPU. Leaving that out
makes each verified draft look dearer than it is: on the H200 the Qwen3-8B shape's step
at 256 requests took 11.0 ms against 8.98 ms on the curve, and the embedded pair's steps
(a tiny model, host-bound) took ~2.8 ms against a forward of a fraction of that, where
``sps`` then admitted nothing. Part of that time is paid per step whatever is verified
(O, growing with the requests: a per request), part with the drafts verified (the
rejection sampler and the output handling work per token: b per draft). A step
verifying n drafts for R requests then takes

    1 / SPS(R + n) + D(R) + O + a R + b n + C [n < R K],

D(R) being the drafter's profiled time per proposal, and ``sps`` maximises
(R + sum of the n best survivals) over that. C is what compacting costs: a step that
verifies all R K drafts runs vLLM's own uniform step, one that verifies fewer rewrites its
batch (:mod:`vllm_dspark.patches.compact_verification`) and dispatches another graph. On
the embedded pair, host-bound, that is most of the difference between an sps step and a
fixed k=7 one: at 256 requests (bfbca4e, H100) input preparation took 2.06 ms against
1.25 ms, while the target's forward for 448 tokens saved 0.05 ms on 2,048; ``sps``, blind to
C, admitted 5.1 drafts of 7 a request and ran 0.61x fixed k=7 (9be793a, H100).

A proposal the draft gate skips is not free either, S: the drafter still stores the new
tokens' context K/V (eagerly, as every proposal does) and the step after it still runs the
speculative path. On the embedded pair at one request (06f3fff, H200) steps after skipped
proposals took 3.6-4.4 ms against 3.4 ms for fixed k=7's, so the gate, weighing not
drafting at 1 / SPS(R) + O + a R with S left out, closed where drafting was 2.2x faster. It
now weighs 1 / SPS(R) + O + a R + S.

``auto`` fits O, a, b, S and C while serving. Each real proposal ends one step, whose host
period (the time since the previous proposal) is the step's cost in steady state, whether
the GPU or the host is the bottleneck; less the curve's forward for the tokens it verified
and D(R) when a proposal was drafted, that is one sample of O + a R + b n (+ S after a
skipped proposal, + C when compacted). Each window's samples, less those far above its
median (a pause or a prefill step in between), join decayed least-squares sums over the
last few windows, from which O, a, b, S and C are fitted (a small ridge keeps a slope at 0
where its variable never varied; none is negative: S stays 0 until the gate has skipped, C
until steps of both kinds ran). An admission that settles stays the same step after step,
which cannot tell b from O, so capacity control verifies half of it now and then
(``control.EXPLORE_EVERY``, on steps verifying at least ``control.EXPLORE_MIN_DRAFTS``, and
with ``acceptance`` only at loads where b could change the depth,
``depth_control.DRAFT_TIME_DOUBT``); with ``sps``, where compacting saves less than the
step's overhead (so that C could decide), every other such probe verifies all R K instead,
so that uncompacted steps are timed too. The host clock differs between tensor-parallel
ranks, so each window's (O, a, b, S, C) is reduced to the largest over ranks on the device
and read one window later (its copy long done): every rank plans with the same values, as
the admission must be identical on every rank.

With plain steps (:mod:`plain_steps`) the alternative to drafting is not a speculative step
that verifies nothing but vLLM's plain decode step, which skips most of that host work: on
the embedded pair (13fb6b1, H200) it took 2.2 ms at 64 requests against 4.9 ms for a
fixed k=7 step, so O + a R + S, fitted on speculative steps, overstated it by more than
half and the gate never closed where no speculation was 1.1-1.3x faster. Plain steps'
periods, less the curve's forward for their R tokens, are fitted apart, as P + p R.

A period is read at the host, which runs a step ahead of the GPU under async scheduling,
so the period around a change of step kind (plain, speculative, or a step the curve does
not describe, such as a prefill) can time the step before it: the first plain step after
a speculative one can read as long as that step. Plain steps come in short runs (a
probe's burst, a closing gate), so such samples can be a large share of them. With DFlash
on the Qwen3-8B shape (94a15b3, H200) P + p R came to 6.7 ms at 64 requests and 7.6 ms at
256, on top of the curve's 5.3 and 7.1 ms, where a whole step of no speculation took 6.2
and 11.4 ms (``step_breakdown.json``, 30752a7), and the gate kept drafting at 256, where
no speculation was faster. How much of that excess was such samples and how much the
plugin's plain step itself (1.33-1.45x a step of no speculation on the embedded pair,
0437bee) is still to be measured. A sample counts only when the step before it was of its
kind (``SETTLE``). A plain step does a part of what a speculative step after a skipped
proposal does (the same forward, context K/V stored, no speculative path), so its price is
held at most O + a R + S: where its fit says more, the fit is wrong, and the gate with plain
steps would keep drafting where the gate without them closes. In the DFlash and ``sps``
runs on the Qwen3-8B shape (757bc32, 5b1d70a, H200) P + p R came to 1.9-4.3 ms + 29-39 us
per request, 9.8-12.0 ms at 256 requests, where O + a R + S came to 4.8-6.2 ms in every
arm but one (11.4, its S 6.2 ms), and a whole step of no speculation spends about 4.1 ms
outside the curve (``step_breakdown_graphs1024_a37526b.json``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

WINDOW = 32  # proposals per fit
OUTLIER = 3.0  # samples above this many times the window's median are left out
DECAY = 0.8  # per window: the fit weighs about the last five windows
# Added to each slope's diagonal, relative to it: a slope stays 0 where its variable never
# varied (or was always 0), and a rare variable (few skipped proposals) is not shrunk.
RIDGE = 1e-5
# Steps of a sample's own kind that must precede it: the host runs one step ahead (async
# scheduling keeps one step in flight). Each more would cost samples where steps of other
# kinds come often (a server's prefills), and a kind with no samples is never fitted.
SETTLE = 1


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


class StepOverhead:
    def __init__(
        self,
        device: torch.device,
        fixed_seconds: float | None = None,
        reduce_max: Callable[[torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``fixed_seconds``: a given O (a = b = 0, no measurement). ``reduce_max``:
        in-place max over tensor-parallel ranks of a device tensor (None: one rank)."""
        self.seconds = fixed_seconds or 0.0  # O
        self.per_request_seconds = 0.0  # a
        self.per_draft_seconds = 0.0  # b
        self.skip_seconds = 0.0  # S
        self.compaction_seconds = 0.0  # C
        self.measuring = fixed_seconds is None
        self.ready = not self.measuring  # whether O and b hold a fit (or were given)
        self._reduce_max = reduce_max
        self._clock = clock
        # (R, n, residual, skipped, compacted, plain) per step
        self._samples: list[tuple[int, int, float, bool, bool, bool]] = []
        self._fit = OverheadFit()
        self._plain_fit = OverheadFit()  # (1, R) columns only: P + p R
        self.plain_seconds = 0.0  # P, 0 until plain steps were measured
        self.plain_per_request_seconds = 0.0  # p
        self._last_time: float | None = None
        self._kinds: deque[str | None] = deque(maxlen=SETTLE + 1)  # latest last
        cuda = device.type == "cuda"
        self._device_value = torch.zeros(7, dtype=torch.float64, device=device)
        self._host_value = torch.zeros(7, dtype=torch.float64, pin_memory=cuda)
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
        """At a real proposal: the step that just ran, for ``num_reqs`` requests, verified
        ``verified_drafts`` drafts (None: not a decode step the curve describes), its
        forward on the curve took ``forward_s`` and the proposal before it ``draft_s`` (0
        when ``skipped``); ``plain``: it was a plain decode step; ``compacted``: its batch
        was compacted."""
        if not self.measuring:
            return
        now = self._clock()
        last, self._last_time = self._last_time, now
        kind = None if verified_drafts is None else "plain" if plain else "speculative"
        self._kinds.append(kind)
        settled = len(self._kinds) > SETTLE and len(set(self._kinds)) == 1
        if last is None or kind is None or not settled:
            return
        residual = max(0.0, now - last - forward_s - draft_s)
        self._samples.append((num_reqs, verified_drafts, residual, skipped, compacted, plain))
        if len(self._samples) < WINDOW:
            return
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
        if self._fit.gram[0, 0] == 0:
            return  # no speculative step yet: nothing to plan with
        plain = self._plain_fit.estimate()[:2] if self._plain_fit.gram[0, 0] > 0 else (0.0, 0.0)
        self._publish((*self._fit.estimate(), *plain))

    def _publish(self, fitted: tuple[float, ...]) -> None:
        """(O, a, b, S, C, P, p) of this window, reduced over ranks and read a window
        later."""
        # The previous window's reduced values (their event long done) become the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            values = self._host_value.tolist()
            self.seconds, self.per_request_seconds, self.per_draft_seconds = values[:3]
            self.skip_seconds, self.compaction_seconds = values[3:5]
            self.plain_seconds, self.plain_per_request_seconds = values[5:]
            self.ready = True
        for value, target in zip(fitted, self._device_value, strict=True):
            target.fill_(value)  # a kernel argument: no copy from pageable memory
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
