"""Capture FULL variable-length CUDA graphs for compacted verification steps.

What: wraps ``ModelCudaGraphManager._init_candidates`` of
``vllm.v1.worker.gpu.cudagraph_utils``, which lists the target's graphs to capture, to
add the compact graphs of :mod:`vllm_dspark.verify.compact_graphs` beside vLLM's own
(only when its cudagraph mode has FULL decode graphs, data parallelism is off and the
attention replays them:
:func:`~vllm_dspark.verify.compact_graphs.replays_varlen_graphs`);
``CudaGraphManager.capture``, which captures them; and ``InputBatch.make_dummy`` of
``vllm.v1.worker.gpu.input_batch``, whose dummy batch a compact graph is captured on with
queries of up to 1 + K tokens
(:func:`~vllm_dspark.verify.compact_graphs.capture_query_lengths`; one token each for the
one-token graphs :mod:`~vllm_dspark.patches.dsv4_compact` adds).
Why: a compacted step's per-request query lengths are chosen on the device, so none of
vLLM 0.26.0's uniform-decode graphs applies, and its mixed-batch PIECEWISE graphs run
attention eagerly between the pieces.
Upstream: vllm-project/vllm#47808 captures variable-length decode graphs in-tree, after
0.26.0.
Remove when: the pinned vLLM captures graphs for variable-length verification.
Applied with :mod:`vllm_dspark.patches.compact_verification`.
"""

from __future__ import annotations

import dataclasses
import sys
from contextvars import ContextVar

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode

from vllm_dspark.patches.wrapping import wrap
from vllm_dspark.verify.compact_graphs import (
    capture_query_lengths,
    compact_graph_descriptors,
    no_compact_graphs,
    replays_varlen_graphs,
)

GRAPHS_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
BATCH_MODULE = "vllm.v1.worker.gpu.input_batch"
# Set on the target's graph manager: its FULL descriptors for compacted steps, smallest
# first (variable-length ones; with DeepSeek-V4's backends one-token ones too).
COMPACT_GRAPHS_ATTR = "dspark_compact_graphs"
# While a compact graph's inputs are prepared for capture: its longest query (1 + K; 1
# for a one-token graph).
_capture_query_len_var: ContextVar[int | None] = ContextVar(
    "vllm_dspark_capture_query_len", default=None
)


def _make_candidates_wrapper(init_candidates):
    def init_candidates_with_compact_graphs(manager):
        init_candidates(manager)
        sizes = manager.compilation_config.cudagraph_capture_sizes
        if manager.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL or not sizes:
            no_compact_graphs(f"no FULL decode graphs, cudagraph_mode={manager.cudagraph_mode}")
            return
        if manager.dp_size > 1:
            no_compact_graphs("data parallelism")
            return
        if manager.decode_query_len < 2 or not replays_varlen_graphs(manager.vllm_config):
            return
        compact = compact_graph_descriptors(
            sizes,
            manager.max_num_reqs,
            manager.decode_query_len - 1,
            manager.compilation_config.max_cudagraph_capture_size,
        )
        add_compact_graphs(manager, compact)

    return init_candidates_with_compact_graphs


def add_compact_graphs(manager, descriptors) -> None:
    """List ``descriptors`` among the manager's compact graphs and the FULL graphs it
    captures (those vLLM lists already once)."""
    compact = getattr(manager, COMPACT_GRAPHS_ATTR, [])
    compact += [desc for desc in descriptors if desc not in compact]
    compact.sort(key=lambda desc: desc.num_tokens)
    full = manager._capture_descs.setdefault(CUDAGraphMode.FULL, [])
    full += [desc for desc in compact if desc not in full]
    full.sort(key=lambda desc: desc.num_tokens, reverse=True)  # vLLM's capture order
    setattr(manager, COMPACT_GRAPHS_ATTR, compact)


def _make_capture_wrapper(capture):
    def capture_with_decode_queries(manager, create_forward_fn, *args, **kwargs):
        compact = getattr(manager, COMPACT_GRAPHS_ATTR, ())
        if not compact:
            return capture(manager, create_forward_fn, *args, **kwargs)

        def create_forward_fn_for(desc, warmup):
            query_len = None
            if desc in compact:
                query_len = desc.uniform_token_count or manager.decode_query_len
            token = _capture_query_len_var.set(query_len)
            try:
                return create_forward_fn(desc, warmup)
            finally:
                _capture_query_len_var.reset(token)

        return capture(manager, create_forward_fn_for, *args, **kwargs)

    return capture_with_decode_queries


def _make_dummy_batch_wrapper(make_dummy):
    def make_dummy_with_decode_queries(cls, *args, **kwargs):
        batch = make_dummy(cls, *args, **kwargs)
        query_len = _capture_query_len_var.get()
        if query_len is None:
            return batch
        lengths = capture_query_lengths(batch.num_reqs, batch.num_tokens, query_len)
        query_start_loc_np = np.zeros(batch.num_reqs + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc_np[1:])
        # Fresh-prefill shape as in vLLM's dummy: each sequence is its query.
        batch.seq_lens.copy_(torch.from_numpy(lengths))
        batch.query_start_loc.copy_(torch.from_numpy(query_start_loc_np))
        return dataclasses.replace(
            batch,
            num_scheduled_tokens=lengths,
            query_start_loc_np=query_start_loc_np,
            seq_lens_cpu_upper_bound=torch.from_numpy(lengths.copy()),
            logits_indices=batch.query_start_loc[1:] - 1,
        )

    return make_dummy_with_decode_queries


def apply() -> None:
    graphs_module = sys.modules[GRAPHS_MODULE]
    wrap(graphs_module.ModelCudaGraphManager, "_init_candidates", _make_candidates_wrapper)
    wrap(graphs_module.CudaGraphManager, "capture", _make_capture_wrapper)
    wrap(sys.modules[BATCH_MODULE].InputBatch, "make_dummy", _make_dummy_batch_wrapper)
