"""Compact verification on DeepSeek-V4's attention backends (on Hopper).

What: three wrappers, active only while a compacted step (not a masked one) builds its
attention metadata for a target whose attention groups include a DeepSeek-V4 backend
(:data:`~vllm_dspark.capacity.startup_checks.DSV4_COMPACTION_BACKENDS`), and one at
graph capture:
``DefaultModelState.prepare_attn`` (``vllm.v1.worker.gpu.model_states.default``) hands
the builders a copy of the batch whose host query offsets and counts are the placeholder
layout of :mod:`vllm_dspark.verify.host_layout` (the runner's own batch is unchanged);
``CommonAttentionMetadata.token_to_req_indices`` (``vllm.v1.attention.backend``) maps
tokens to requests from the device query offsets into the caller's persistent buffer,
not from the host offsets; ``DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors``
(``vllm.v1.attention.backends.mla.indexer``) takes its flattened variable-length branch,
whose rows follow the device query lengths. No host sync is added.
``ModelCudaGraphManager.capture`` (``vllm.v1.worker.gpu.cudagraph_utils``) adds, where the
target has compact graphs (:mod:`vllm_dspark.patches.compact_graphs`), one-token FULL
graphs for the compacted steps that admit no draft.
Why: in vLLM 0.26.0 these builders read per-request query lengths on the host: the
decode/prefill split, the token-to-request map of the sliding-window, compressor and
ratio-128 metadata, and the indexer's choice of a uniform layout (request = token //
(1 + K)). A compacted batch's lengths are chosen on the GPU, so the stock host layout
(1 + K per decoding request) would silently misplace tokens. A step that admits no draft
has one token a request, where the indexer writes per-request rows (and its compressed
lengths) into other buffers than the flattened rows a compact graph was captured on: it
replays a graph captured on one-token rows, as vLLM's plain decode steps would.
Upstream: vllm-project/vllm#47808 (adaptive verification writes a host placeholder
layout) and #52795 (DeepSeek-V4 on Hopper: indexer rows from device lengths), after 0.26.0.
Remove when: the pinned vLLM verifies a device-chosen subset of drafts on DeepSeek-V4.
Applied beside :mod:`vllm_dspark.patches.compact_verification`, by
:mod:`vllm_dspark.patches.speculator_selection`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from contextvars import ContextVar

import torch

from vllm_dspark.capacity.startup_checks import DSV4_COMPACTION_BACKENDS
from vllm_dspark.patches import compact_graphs, compact_verification
from vllm_dspark.patches.wrapping import wrap
from vllm_dspark.verify.compact_graphs import one_token_graph_descriptors
from vllm_dspark.verify.host_layout import (
    placeholder_query_lens,
    placeholder_query_start_loc,
    token_requests,
)

MODEL_STATE_MODULE = "vllm.v1.worker.gpu.model_states.default"
BACKEND_MODULE = "vllm.v1.attention.backend"
INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"
GRAPHS_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
# True while a compacted step's DeepSeek-V4 attention metadata is being built.
_compacted_var: ContextVar[bool] = ContextVar("vllm_dspark_dsv4_compacted", default=False)


def reads_host_layout(attn_groups) -> bool:
    """Whether any attention group runs a DeepSeek-V4 backend."""
    return any(
        group.backend.get_name() in DSV4_COMPACTION_BACKENDS
        for groups in attn_groups
        for group in groups
    )


def placeholder_batch(input_batch, plan):
    """``input_batch`` (compacted on the device) with the host query counts and offsets of
    its placeholder layout."""
    decodes = plan.mixed[0] if plan.mixed else input_batch.num_reqs
    lens = placeholder_query_lens(input_batch.num_scheduled_tokens, decodes, plan.budget)
    query_start_loc = placeholder_query_start_loc(lens, len(input_batch.query_start_loc_np) - 1)
    if query_start_loc[-1] != input_batch.num_tokens:
        raise RuntimeError(
            f"placeholder of {query_start_loc[-1]} tokens for a batch of {input_batch.num_tokens}"
        )
    return dataclasses.replace(
        input_batch, num_scheduled_tokens=lens, query_start_loc_np=query_start_loc
    )


def _make_prepare_attn_wrapper(prepare_attn):
    def prepare_attn_with_placeholder(
        self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, *args, **kw
    ):
        rest = (cudagraph_mode, block_tables, slot_mappings, attn_groups, *args)
        plan = compact_verification.compacting_plan()
        if plan is None or not reads_host_layout(attn_groups):
            return prepare_attn(self, input_batch, *rest, **kw)
        placeholder = placeholder_batch(input_batch, plan)
        token = _compacted_var.set(True)
        try:
            return prepare_attn(self, placeholder, *rest, **kw)
        finally:
            _compacted_var.reset(token)

    return prepare_attn_with_placeholder


def _make_token_map_wrapper(token_to_req_indices):
    def token_to_req_indices_from_device(self, buffer: torch.Tensor) -> torch.Tensor:
        if not _compacted_var.get() or self._token_to_req_indices_cache is not None:
            return token_to_req_indices(self, buffer)
        mapped = buffer[: self.num_actual_tokens]
        token_requests(self.query_start_loc, self.num_reqs, mapped)
        self._token_to_req_indices_cache = mapped  # the other builders reuse it, as in stock
        return mapped

    return token_to_req_indices_from_device


def _make_decode_rows_wrapper(prepare_decode_tensors):
    def prepare_decode_tensors_varlen(
        self,
        seq_lens,
        block_table,
        decode_lens,
        decode_lens_cpu,
        query_start_loc,
        num_decodes,
        num_decode_tokens,
        use_native,
        next_n,
        max_decode_len,
    ):
        if _compacted_var.get() and not use_native and max_decode_len > 1:
            # One empty row more: the host total the variable branch sizes its rows by is
            # kept, and the host lengths are never uniform, so that branch is taken.
            decode_lens_cpu = torch.cat([decode_lens_cpu, decode_lens_cpu.new_zeros(1)])
        return prepare_decode_tensors(
            self,
            seq_lens=seq_lens,
            block_table=block_table,
            decode_lens=decode_lens,
            decode_lens_cpu=decode_lens_cpu,
            query_start_loc=query_start_loc,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            use_native=use_native,
            next_n=next_n,
            max_decode_len=max_decode_len,
        )

    return prepare_decode_tensors_varlen


def _make_capture_wrapper(capture):
    signature = inspect.signature(capture)

    def capture_with_one_token_graphs(manager, *args, **kwargs):
        attn_groups = signature.bind(manager, *args, **kwargs).arguments["attn_groups"]
        if getattr(manager, compact_graphs.COMPACT_GRAPHS_ATTR, None) and reads_host_layout(
            attn_groups
        ):
            config = manager.compilation_config
            one_token = one_token_graph_descriptors(
                config.cudagraph_capture_sizes,
                manager.max_num_reqs,
                config.max_cudagraph_capture_size,
            )
            compact_graphs.add_compact_graphs(manager, one_token)
        return capture(manager, *args, **kwargs)

    return capture_with_one_token_graphs


def apply() -> None:
    model_state = importlib.import_module(MODEL_STATE_MODULE).DefaultModelState
    wrap(model_state, "prepare_attn", _make_prepare_attn_wrapper)
    metadata = importlib.import_module(BACKEND_MODULE).CommonAttentionMetadata
    wrap(metadata, "token_to_req_indices", _make_token_map_wrapper)
    indexer = importlib.import_module(INDEXER_MODULE).DeepseekV32IndexerMetadataBuilder
    wrap(indexer, "_prepare_decode_tensors", _make_decode_rows_wrapper)
    graphs = importlib.import_module(GRAPHS_MODULE).ModelCudaGraphManager
    wrap(graphs, "capture", _make_capture_wrapper)
