"""Rowwise FP8 (e4m3) copies of head weights, and the pure-PyTorch reference of the draft head.

Quantisation. Each row ``t`` of a ``[V, H]`` weight (or of an activation matrix, one row per
token) is stored as ``q = rne(t / s)`` in ``float8_e4m3fn`` with one fp32 scale per row,
``s = max|t| / 448``: the largest element maps onto the largest finite e4m3 value. An all-zero
row gets ``s = 1`` (so ``q = 0`` and nothing divides by zero). Weights must be finite
(:meth:`Fp8RowwiseWeight.from_weight` raises otherwise). Activations are checked at run time
instead: a row holding NaN or +-inf gets ``s = NaN``, which makes every logit of that row NaN;
e4m3 has no infinity, so without this an inf would silently saturate to 448.

Error bound. e4m3 keeps 3 mantissa bits: in its normal range (``|q| >= 2**-6``) rounding to
nearest changes a value by at most ``u = 2**-4`` of itself, below it (subnormal spacing
``2**-9``) by at most ``d = 2**-10`` absolute. After scaling, each element satisfies
``|deq(t) - t| <= u |t| + d s``. For a logit ``z = sum_h x_h w_h`` computed from dequantised
operands, ``|x'w' - xw| <= |x'| |w' - w| + |x' - x| |w|`` summed over ``h`` gives

    weight only (bf16 activations):  u A + d s_w Sx
    weight and activations:          (2u + u^2) A + (1 + u) d (s_x Sw + s_w Sx) + H d^2 s_x s_w

with ``A = sum_h |x_h||w_h|``, ``Sx = sum_h |x_h|``, ``Sw = sum_h |w_h|``
(:func:`logit_error_bound`). It is a worst case (every rounding error aligned); on random
data the observed error is far smaller (errors of random sign cancel), so "argmax agrees with
bf16" can be asserted only where the exact winner leads every other logit by more than the
two bounds.

Non-finite policy of the argmax (shared with the Triton kernels): a row with any NaN or +-inf
logit among its first ``vocab_limit`` columns returns index -1 and value NaN, so a caller can
detect it and no token is drafted from garbage (an inf activation on the bf16-activation path
gives +-inf logits, not NaN; real logits are never infinite). Columns at or beyond
``vocab_limit`` (padding rows of vLLM's ParallelLMHead) never win and are not part of the
returned logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E4M3_REL_ERR = 2.0**-4  # u: half an ulp of a 3-bit mantissa, relative
E4M3_SUBNORMAL_ABS_ERR = 2.0**-10  # d: half the subnormal spacing 2**-9, in units of the scale


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 quantisation of a 2-D tensor: ``(q [R, C] e4m3, scale [R] fp32)``.

    Rows holding NaN or +-inf get scale NaN (see the module docstring).
    """
    if t.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(t.shape)}")
    t32 = t.float()
    amax = t32.abs().amax(dim=1)  # propagates NaN
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    q = (t32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True)
class Fp8RowwiseWeight:
    """A head weight ``[V, H]`` stored as e4m3 rows with one fp32 scale per row."""

    weight: torch.Tensor  # float8_e4m3fn [V, H], contiguous
    scale: torch.Tensor  # float32 [V]

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() != 2:
            raise ValueError("weight must be a 2-D float8_e4m3fn tensor")
        if not self.weight.is_contiguous():
            raise ValueError("weight must be contiguous")
        if self.scale.dtype != torch.float32 or self.scale.shape != (self.weight.shape[0],):
            raise ValueError(f"scale must be float32 of shape ({self.weight.shape[0]},)")
        if self.scale.device != self.weight.device:
            raise ValueError("weight and scale must be on one device")

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Fp8RowwiseWeight:
        """Quantise a finite ``[V, H]`` weight (any float dtype). One host sync: load time only."""
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("head weight holds NaN or inf; refusing to quantise it")
        q, scale = quantize_rows(weight)
        return cls(q.contiguous(), scale.contiguous())

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden(self) -> int:
        return self.weight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]


def _dequantized_activations(x: torch.Tensor, act_fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    if not act_fp8:
        return x.to(dtype)
    q, scale = quantize_rows(x)
    return q.to(dtype) * scale.to(dtype)[:, None]


def _as_dense(weight: torch.Tensor | Fp8RowwiseWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, Fp8RowwiseWeight):
        return weight.dequantize(dtype)
    return weight.to(dtype)


def reference_logits(
    x: torch.Tensor,
    head: Fp8RowwiseWeight,
    *,
    act_fp8: bool = True,
    markov_embed: torch.Tensor | None = None,
    markov_weight: torch.Tensor | Fp8RowwiseWeight | None = None,
    vocab_limit: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """What the kernels compute, in ``dtype``: ``[rows, vocab_limit]`` logits.

    ``x @ deq(W).T`` (with ``x`` itself rowwise-quantised when ``act_fp8``) plus, when given,
    the low-rank Markov bias ``markov_embed @ W2.T`` (``markov_embed`` is never quantised).
    """
    limit = head.vocab if vocab_limit is None else vocab_limit
    logits = _dequantized_activations(x, act_fp8, dtype) @ head.dequantize(dtype)[:limit].T
    if (markov_embed is None) != (markov_weight is None):
        raise ValueError("markov_embed and markov_weight go together")
    if markov_embed is not None:
        logits = logits + markov_embed.to(dtype) @ _as_dense(markov_weight, dtype)[:limit].T
    return logits


def argmax_with_nan_policy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise ``(index int64, value fp32)``; lowest index on ties; rows with a NaN or
    infinite logit give (-1, NaN)."""
    bad_rows = ~torch.isfinite(logits).all(dim=1)
    value, index = logits.max(dim=1)  # max(dim) returns the first maximal index
    index = torch.where(bad_rows, torch.full_like(index, -1), index)
    value = torch.where(bad_rows, torch.full_like(value, float("nan")), value)
    return index, value.float()


def reference_argmax(
    x: torch.Tensor, head: Fp8RowwiseWeight, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy draft token per row of :func:`reference_logits` (same keyword arguments)."""
    return argmax_with_nan_policy(reference_logits(x, head, **kwargs))


def logit_error_bound(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    act_fp8: bool,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Worst-case ``|quantised logit - exact logit|``, ``[rows, V]``, for the bf16 ``weight``.

    See the module docstring for the derivation.
    """
    u, d = E4M3_REL_ERR, E4M3_SUBNORMAL_ABS_ERR
    ax, aw = x.to(dtype).abs(), weight.to(dtype).abs()
    s_w = aw.amax(dim=1) / E4M3_MAX
    sum_x = ax.sum(dim=1)
    a = ax @ aw.T
    if not act_fp8:
        return u * a + d * sum_x[:, None] * s_w[None, :]
    s_x = ax.amax(dim=1) / E4M3_MAX
    sum_w = aw.sum(dim=1)
    cross = s_x[:, None] * sum_w[None, :] + sum_x[:, None] * s_w[None, :]
    return (2 * u + u * u) * a + (1 + u) * d * cross + x.shape[1] * d * d * s_x[:, None] * s_w
