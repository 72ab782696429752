"""FULL CUDA graphs for compacted verification steps, bucketed by total tokens.

A compacted decode step runs R + B tokens with per-request query lengths chosen on the
device (:mod:`vllm_dspark.verify.compaction`), so none of vLLM's uniform-decode graphs
applies and vLLM would fall back to PIECEWISE graphs with attention run eagerly. A graph
replays the kernels and host values of its capture and reads the persistent buffers the
runner and the attention builders rewrite before each replay; so one FULL graph captured
for T tokens and up to min(T, max_num_seqs) requests serves any compacted batch that fits
if the builders write a compacted batch's metadata into the buffers they wrote at
capture, and take the same host-side branches. A step takes the smallest graph.

- FlashAttention 3 reads query offsets, sequence lengths and its tile schedule from such
  buffers. What it fixes at capture follows the maximum query length (with 1 it drops the
  causal mask for head sizes other than 128), so compact graphs are captured on
  :func:`capture_query_lengths`, whose longest query is 1 + K.
- DeepSeek-V4's backends on SM90 (:mod:`vllm_dspark.patches.dsv4_compact`): on that
  layout and on a compacted step's placeholder layout alike, every request is a decode,
  the indexer flattens its rows into the same buffers, FlashMLA plans inside the graph,
  and the sliding-window, ratio-128 and compressor metadata are per token. A step that
  admits no draft (B = 0, every query one token) is the exception: the indexer then keeps
  per-request rows in other buffers, so it replays a one-token graph
  (:func:`one_token_graph_descriptors`), as vLLM's own plain decode steps would.

Other backends bake more of the batch into a graph: with them compacted steps run
PIECEWISE, as any mixed batch.
"""

from __future__ import annotations

import numpy as np
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from vllm_dspark.capacity.startup_checks import DSV4_COMPACTION_BACKENDS

logger = init_logger(f"vllm.{__name__}")


def replays_varlen_graphs(vllm_config) -> bool:
    """Whether the attention of every layer (the draft's too: its layers are in the same
    forward context) replays compact graphs, else False (logged): FlashAttention 3 on all
    of them; or DeepSeek-V4's backends on all of them, on SM90, with at least 2 drafts
    (the indexer flattens its rows) and an engine started with ``varlen_verify`` (one
    started masked compacts no step unless switched, and its graphs would be captured for
    nothing)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from vllm_dspark.config import DSparkOptions

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values()
    names = {layer.get_attn_backend().get_name() for layer in layers}
    if names == {"FLASH_ATTN"} and all(
        # FlashAttention falls back to version 2 for head sizes version 3 lacks.
        get_flash_attn_version(head_size=getattr(layer, "head_size", None)) == 3
        for layer in layers
    ):
        return True
    if names and names <= set(DSV4_COMPACTION_BACKENDS):
        num_drafts = vllm_config.speculative_config.num_speculative_tokens
        if not current_platform.is_device_capability_family(90) or num_drafts < 2:
            reason = "DeepSeek-V4's backends take compacted steps on SM90 with 2 drafts or more"
        elif not DSparkOptions.from_vllm_config(vllm_config).varlen_verify:
            reason = "the engine started with varlen_verify=false"
        else:
            return True
    else:
        reason = (
            f"attention backends {', '.join(sorted(names)) or 'none'}; compact graphs need "
            "FlashAttention 3 or DeepSeek-V4's backends on every layer"
        )
    no_compact_graphs(reason)
    return False


def no_compact_graphs(reason: str) -> None:
    """Log why compacted steps will run PIECEWISE."""
    logger.info(
        "vllm-dspark: no compact FULL CUDA graphs (%s): compacted steps run PIECEWISE", reason
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


def one_token_graph_descriptors(
    capture_sizes: list[int], max_num_reqs: int, max_capture_size: int
) -> list[BatchExecutionDescriptor]:
    """One FULL descriptor of one-token queries per capture size up to max_num_seqs,
    smallest first: vLLM's own plain-decode graphs (as it lists them for Dynamic SD), for
    compacted steps that admit no draft."""
    return [
        BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL, num_tokens=size, num_reqs=size, uniform_token_count=1
        )
        for size in sorted(set(capture_sizes))
        if size <= min(max_num_reqs, max_capture_size)
    ]


def pick_compact_graph(
    descriptors: list[BatchExecutionDescriptor], captured, num_reqs: int, num_tokens: int
) -> BatchExecutionDescriptor | None:
    """The smallest captured descriptor holding ``num_reqs`` requests and ``num_tokens``
    tokens, or None (the step then runs as vLLM would run a mixed batch). Where the list
    has one-token graphs (DeepSeek-V4), a step of one token a request takes one of them
    and every other step a variable-length one."""
    one_token = num_tokens == num_reqs and any(
        desc.uniform_token_count == 1 for desc in descriptors
    )
    for desc in descriptors:
        if (
            (desc.uniform_token_count == 1) == one_token
            and desc.num_tokens >= num_tokens
            and desc.num_reqs >= num_reqs
            and desc in captured
        ):
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
