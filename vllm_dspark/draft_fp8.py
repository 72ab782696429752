"""The drafter's own layers in FP8 (``dspark_fp8_draft_backbone``).

Once the draft model has loaded in bf16, every linear layer of its decoder layers
(attention projections and MLP) gets a rowwise-FP8 copy of its weight (one e4m3 row and
one fp32 scale per output channel, :func:`vllm_dspark.head.fp8_rowwise.quantize_rows`) in
place of the bf16 one, and a quantisation method that quantises each token's activations
the same way and multiplies with ``torch._scaled_mm`` (cuBLASLt's rowwise-scaled FP8 GEMM
on Hopper). Nothing else changes: the target, its heads and verification keep their
weights, so outputs stay lossless; only the drafts (and so the acceptance) can differ.

Why: under load the drafter's backbone runs 1 + K query tokens per request whatever the
depth, in compute-bound GEMMs that FP8 runs at up to twice the rate. vLLM 0.26.0's online
quantisation does not fit the draft model (its speculative config drops the online
arguments, and DFlash-family drafters slice their context-K/V projection out of each bf16
``qkv_proj.weight``), so the drafter loads exactly as stock, the context-K/V projection is
built from the bf16 weights first (it stays bf16, as stock computes it), and only then do
the layers change.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from vllm_dspark.head.draft_heads import check_fp8_supported
from vllm_dspark.head.fp8_rowwise import Fp8RowwiseWeight, quantize_rows

logger = init_logger(f"vllm.{__name__}")

GEMM_ALIGNMENT = 16


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a rowwise-FP8 ``W`` (``weight`` e4m3 [N, K], ``scale`` fp32
    [N]), with ``x`` quantised per token. On a GPU through ``torch._scaled_mm``; elsewhere
    (CPU tests: PyTorch's CPU kernel takes per-tensor scales only) through the dequantised
    operands, the same product in float32."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows(rows)
    if x.is_cuda:
        out = torch._scaled_mm(
            x_q,
            weight.t(),
            scale_a=x_scale[:, None],
            scale_b=scale[None, :],
            out_dtype=x.dtype,
        )
    else:
        out = ((x_q.float() * x_scale[:, None]) @ (weight.float() * scale[:, None]).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Fp8DraftLinearMethod(QuantizeMethodBase):
    """The quantisation method of a drafter layer whose weight was replaced by
    :func:`quantize_draft_backbone`; weights are never created through it."""

    def create_weights(self, *args, **kwargs) -> None:
        raise RuntimeError("vllm-dspark: FP8 draft layers are converted after loading")

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # already in their final form


def quantize_draft_backbone(model: torch.nn.Module) -> int:
    """Put the bf16 linear layers of a loaded drafter's decoder layers
    (``model.model.layers``) in rowwise FP8; returns how many. A DFlash-family drafter's
    context-K/V projection is built from the bf16 weights first (vLLM builds it when real
    weights load, and lazily at the first store with dummy weights, which would then read
    FP8 rows)."""
    inner = model.model
    first = next(inner.layers.parameters(), None)
    if first is not None and first.is_cuda:  # (the CPU tests run the dequantised product)
        check_fp8_supported("fp8_draft_backbone", first)
    if hasattr(inner, "_build_fused_kv_buffers"):
        inner._build_fused_kv_buffers()
    converted = 0
    for layer in inner.layers.modules():
        if (
            not isinstance(layer, LinearBase)
            or type(layer.quant_method) is not UnquantizedLinearMethod
        ):
            continue
        weight = layer.weight
        if weight.shape[0] % GEMM_ALIGNMENT or weight.shape[1] % GEMM_ALIGNMENT:
            continue  # cuBLASLt's FP8 GEMM needs both sides in multiples of 16
        if weight.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(
                f"vllm-dspark: dspark_fp8_draft_backbone quantises bf16 or fp16 layers; "
                f"{type(layer).__name__} holds {weight.dtype}."
            )
        try:
            fp8 = Fp8RowwiseWeight.from_weight(weight.data)
        except ValueError as error:  # a NaN or inf in the weight
            raise RuntimeError(
                f"vllm-dspark: dspark_fp8_draft_backbone found a non-finite weight in "
                f"{type(layer).__name__}."
            ) from error
        layer.weight = torch.nn.Parameter(fp8.weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(fp8.scale, requires_grad=False)
        layer.quant_method = Fp8DraftLinearMethod()
        converted += 1
    logger.info("vllm-dspark: %d drafter layers run in rowwise FP8.", converted)
    return converted
