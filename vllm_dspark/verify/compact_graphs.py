"""FULL CUDA graphs for compacted verification steps, bucketed by total tokens.

A compacted decode step runs R + B tokens with per-request query lengths chosen on the
device (:mod:`vllm_dspark.verify.compaction`), so none of vLLM's uniform-decode graphs
applies and vLLM would fall back to PIECEWISE graphs with attention run eagerly. FlashAttention
3 reads query offsets, sequence lengths and its tile schedule from the persistent buffers
the runner writes before a replay, so one FULL graph captured for T tokens and up to
min(T, max_num_seqs) requests serves any compacted batch that fits; a step takes the
smallest. What FlashAttention 3 fixes at capture follows the maximum query length (with 1
it drops the causal mask for head sizes other than 128), so compact graphs are captured on
:func:`capture_query_lengths`, whose longest query is 1 + K. Other backends bake more of
the batch into a graph, so with them compacted steps run PIECEWISE, as any mixed batch.
DeepSeek-V4's backends (:mod:`vllm_dspark.patches.dsv4_compact`) are among them for now:
a compact graph is captured on flattened indexer rows, but a step that admits no draft
(every query one token) gets the indexer's per-request rows, in other buffers.
"""

from __future__ import annotations

import numpy as np
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor


def replays_varlen_graphs(vllm_config) -> bool:
    """Whether every attention layer (the draft's too: its layers are in the same forward
    context) runs FlashAttention 3, which reads a compacted batch's layout at replay
    (DeepSeek-V4's compacted steps run PIECEWISE: see the module's docstring)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values()
    return bool(layers) and all(
        layer.get_attn_backend().get_name() == "FLASH_ATTN"
        # FlashAttention falls back to version 2 for head sizes version 3 lacks.
        and get_flash_attn_version(head_size=getattr(layer, "head_size", None)) == 3
        for layer in layers
    )


def compact_graph_descriptors(
    capture_sizes: list[int], max_num_reqs: int, num_drafts: int, max_capture_size: int
) -> list[BatchExecutionDescriptor]:
    """One FULL variable-length descriptor per capture size a compacted step can reach
    (at least one request and one admitted draft), smallest first."""
    most_tokens = min(max_num_reqs * (1 + num_drafts), max_capture_size)
    return [
        BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL, num_tokens=size, num_reqs=min(size, max_num_reqs)
        )
        for size in sorted(set(capture_sizes))
        if 2 <= size <= most_tokens
    ]


def pick_compact_graph(
    descriptors: list[BatchExecutionDescriptor], captured, num_reqs: int, num_tokens: int
) -> BatchExecutionDescriptor | None:
    """The smallest captured descriptor holding ``num_reqs`` requests and ``num_tokens``
    tokens, or None (the step then runs as vLLM would run a mixed batch)."""
    for desc in descriptors:
        if desc.num_tokens >= num_tokens and desc.num_reqs >= num_reqs and desc in captured:
            return desc
    return None


def capture_query_lengths(num_reqs: int, num_tokens: int, query_len: int) -> np.ndarray:
    """Tokens per request of the dummy batch a compact graph is captured on: ``query_len``
    each from the first request, the remainder on the next, then empty queries (as padded
    requests have at replay). Needs num_tokens <= num_reqs * query_len."""
    if not 0 < num_tokens <= num_reqs * query_len:
        raise ValueError(f"{num_tokens} tokens do not fit {num_reqs} queries of {query_len}")
    full, rest = divmod(num_tokens, query_len)
    lengths = np.zeros(num_reqs, dtype=np.int32)
    lengths[:full] = query_len
    if rest:
        lengths[full] = rest
    return lengths
