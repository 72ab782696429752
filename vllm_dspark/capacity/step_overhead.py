"""The part of a speculative step's time that the SPS curve does not see.

The SPS curve times the target's forward alone, on dummy requests that attend only their
own query tokens; a real step also schedules, prepares inputs, reads each request's context
K/V, samples, rejects and hands its output back. Left out, that makes each verified draft
look dearer than it is. A step verifying n drafts for R decoding requests (and Q prompt
tokens, when it carries prompts) is modelled as

    1 / SPS(R + n + Q) + D + O + a R + b n + C [n < R K] + q Q,

D the drafter's profiled time per proposal, O + a R paid per step (a grows with the
requests' context), b per verified draft, C what compacting costs over vLLM's own uniform
step, q what a prompt token costs beyond the curve. A skipped proposal still costs S
(context K/V stored, speculative path run); a plain decode step (:mod:`plain_steps`) costs
P + p R, fitted apart and held at most O + a R + S. Admission weighs 1 / SPS(R + n) + D
+ O + a R + b n + C: a served request's prompt is the same work however many drafts its
steps verify.

``auto`` fits these while serving: each proposal's host period, less the curve's forward
and D, is one sample; windows of samples (outliers dropped) join decayed, lightly ridged
least squares. Steps that carry prompts are samples too: under load they are most steps,
and the K/V their requests read (a R) is much of what speculation saves. A sample counts
only after ``SETTLE`` steps of its kind (plain, decode, with prompts), as the host runs a
step ahead of the GPU. Each window's values are reduced to the largest over
tensor-parallel ranks and read a window later, so every rank plans the same admission.
Measurements behind this model: ``docs/design/module-notes.md``.
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
    """Decayed least-squares sums for r = O + a R + b n + S z + C c + q Q (R requests, n
    drafts verified, z = 1 after a skipped proposal, c = 1 in a compacted step, Q prompt
    tokens)."""

    def __init__(self):
        self.gram = np.zeros((6, 6))  # sum of x x^T, x = (1, R, n, z, c, Q)
        self.moment = np.zeros(6)  # sum of x r

    def add(
        self,
        requests: np.ndarray,
        drafts: np.ndarray,
        residuals: np.ndarray,
        skipped: np.ndarray | None = None,
        compacted: np.ndarray | None = None,
        prompt_tokens: np.ndarray | None = None,
    ) -> None:
        """One window's samples, less its outliers; earlier windows decay."""
        keep = residuals <= OUTLIER * np.median(residuals) + 1e-6
        zeros = np.zeros_like(residuals)
        skipped = zeros if skipped is None else skipped
        compacted = zeros if compacted is None else compacted
        prompt_tokens = zeros if prompt_tokens is None else prompt_tokens
        columns = [np.ones(len(residuals)), requests, drafts, skipped, compacted, prompt_tokens]
        x = np.stack([column[keep] for column in columns], axis=1)
        self.gram = DECAY * self.gram + x.T @ x
        self.moment = DECAY * self.moment + x.T @ residuals[keep]

    def estimate(self) -> tuple[float, float, float, float, float, float]:
        """(O, a, b, S, C, q), all >= 0: a slope the data make negative is left out and the
        rest refitted."""
        slopes = [1, 2, 3, 4, 5]
        while True:
            terms = [0, *slopes]
            ridge = [RIDGE * self.gram[term, term] + 1e-30 for term in slopes]
            gram = self.gram[np.ix_(terms, terms)] + np.diag([0.0, *ridge])
            fitted = np.linalg.solve(gram, self.moment[terms])
            negative = [term for term, value in zip(slopes, fitted[1:], strict=True) if value < 0]
            if not negative:
                break
            slopes = [term for term in slopes if term not in negative]
        values = np.zeros(6)
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
        self.prompt_token_seconds = 0.0  # q (fitted so that O and a leave it out)
        self.measuring = fixed_seconds is None
        self.ready = not self.measuring  # whether O and b hold a fit (or were given)
        self._reduce_max = reduce_max
        self._clock = clock
        # (R, n, residual, skipped, compacted, prompt tokens, plain) per step
        self._samples: list[tuple[int, int, float, bool, bool, int, bool]] = []
        self._fit = OverheadFit()
        self._plain_fit = OverheadFit()  # (1, R) columns only: P + p R
        self.plain_seconds = 0.0  # P, 0 until plain steps were measured
        self.plain_per_request_seconds = 0.0  # p
        self._last_time: float | None = None
        self._kinds: deque[str | None] = deque(maxlen=SETTLE + 1)  # latest last
        cuda = device.type == "cuda"
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
        prompt_tokens: int = 0,
    ) -> None:
        """At a real proposal: the step that just ran, for ``num_reqs`` decoding requests,
        verified ``verified_drafts`` drafts (None: not a step the curve describes), its
        forward on the curve took ``forward_s`` and the proposal before it ``draft_s`` (0
        when ``skipped``); ``plain``: it was a plain decode step; ``compacted``: its batch
        was compacted; ``prompt_tokens``: the prompt tokens it also carried."""
        if not self.measuring:
            return
        now = self._clock()
        last, self._last_time = self._last_time, now
        kind = None
        if verified_drafts is not None:
            kind = "plain" if plain else "prompts" if prompt_tokens else "decode"
        self._kinds.append(kind)
        settled = len(self._kinds) > SETTLE and len(set(self._kinds)) == 1
        if last is None or kind is None or not settled:
            return
        residual = max(0.0, now - last - forward_s - draft_s)
        sample = (num_reqs, verified_drafts, residual, skipped, compacted, prompt_tokens, plain)
        self._samples.append(sample)
        if len(self._samples) < WINDOW:
            return
        samples = np.array(self._samples, dtype=np.float64)
        plain_rows = samples[:, 6] > 0
        speculative = samples[~plain_rows]
        if len(speculative):
            self._fit.add(*speculative[:, :6].T)
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
        """(O, a, b, S, C, q, P, p) of this window, reduced over ranks and read a window
        later."""
        # The previous window's reduced values (their event long done) become the estimate.
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            values = self._host_value.tolist()
            self.seconds, self.per_request_seconds, self.per_draft_seconds = values[:3]
            self.skip_seconds, self.compaction_seconds, self.prompt_token_seconds = values[3:6]
            self.plain_seconds, self.plain_per_request_seconds = values[6:]
            self.ready = True
        for value, target in zip(fitted, self._device_value, strict=True):
            target.fill_(value)  # a kernel argument: no copy from pageable memory
        if self._reduce_max is not None:
            self._reduce_max(self._device_value)
        self._host_value.copy_(self._device_value, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True
