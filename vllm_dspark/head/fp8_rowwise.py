"""Rowwise FP8 (e4m3) copies of head weights, and the pure-PyTorch reference of the draft head.

Each row ``t`` of a ``[V, H]`` weight (or of an activation matrix, one row per token) is
stored as ``q = rne(t / s)`` in ``float8_e4m3fn`` with one fp32 scale ``s = max|t| / 448``
per row (``s = 1`` for an all-zero row). Weights must be finite; an activation row holding
NaN or +-inf gets ``s = NaN`` (e4m3 has no infinity, so an inf would otherwise saturate to
448 silently). :func:`logit_error_bound` gives the worst-case logit error of the quantised
product, against which "argmax agrees with bf16" can be asserted. The argmax returns index
-1 and value NaN for a row with a non-finite logit among its first ``vocab_limit`` columns,
so no token is drafted from garbage; columns past ``vocab_limit`` (vLLM's padding rows)
never win and are not returned.
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

    With u = 2**-4 (relative rounding in e4m3's normal range) and d = 2**-10 (absolute,
    subnormal), A = sum_h |x_h||w_h|, Sx = sum_h |x_h|, Sw = sum_h |w_h|:
    u A + d s_w Sx for the weight alone, (2u + u^2) A + (1 + u) d (s_x Sw + s_w Sx)
    + H d^2 s_x s_w with activations quantised too. Derivation:
    ``docs/design/module-notes.md``.
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
