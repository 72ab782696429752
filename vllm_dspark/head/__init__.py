"""Rowwise-FP8 draft LM head: quantised weights, a PyTorch reference and Triton kernels."""

from vllm_dspark.head.fp8_head_kernel import (
    HeadTileConfig,
    HeadWorkspace,
    default_config,
    fp8_head_argmax,
    fp8_head_logits,
    quantize_activations,
)
from vllm_dspark.head.fp8_rowwise import Fp8RowwiseWeight, quantize_rows

__all__ = [
    "Fp8RowwiseWeight",
    "HeadTileConfig",
    "HeadWorkspace",
    "default_config",
    "fp8_head_argmax",
    "fp8_head_logits",
    "quantize_activations",
    "quantize_rows",
]
