"""The drafter's context-K/V store, replayed from CUDA graphs.

DFlash and DSpark drafters attend to K/V of every target token (their "context"), which
``precompute_and_store_context_kv`` projects from the target's hidden states and writes to
the draft layers' caches once per step. vLLM 0.26.0 runs that store eagerly, as its token
count varies per step: 8 + L kernel launches (L draft layers) whose host cost is far above
their GPU time. Here the store is captured once per token count of the target's CUDA-graph
sizes, on the speculator's own fixed buffers, and a step replays the smallest graph that
holds its tokens; rows past the step's tokens get slot -1, which every KV-cache write skips.
A store on other tensors (dummy runs, token counts past the largest graph) runs eagerly.
With the drafter's layers in FP8 (:mod:`vllm_dspark.draft_fp8`) the store keeps the bf16
projection. The method is shadowed on the drafter instance a vllm-dspark speculator owns,
never on its class: stock speculators keep stock's eager store.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from vllm_dspark.draft_fp8 import quantize_draft_backbone

PAD_SLOT_ID = -1  # vLLM's padding slot (vllm.v1.attention.backends.utils): no cache write


class ContextKVGraphs:
    """Graph replays of one drafter's context-K/V store.

    states: [T, H] hidden states, positions: [T], slot_rows: [G, T] one slot mapping per
    draft KV-cache group (the speculator's buffers, written before each store);
    layer_rows: each draft layer's row of ``slot_rows``, or None where every layer shares
    row 0 (how stock passes them to the model)."""

    def __init__(self, model, states, positions, slot_rows, layer_rows, sizes):
        # The class's method: a second ContextKVGraphs on the model does not wrap the first.
        self._eager = type(model).precompute_and_store_context_kv.__get__(model)
        self.states, self.positions, self.slot_rows = states, positions, slot_rows
        self.layer_rows = layer_rows
        # Where a store on the captured buffers reads: their first rows' addresses.
        self._buffer_ptrs = (states.data_ptr(), positions.data_ptr())
        self._slot_ptrs = [slot_rows[row].data_ptr() for row in layer_rows or [0]]
        limit = min(states.shape[0], positions.shape[0], slot_rows.shape[1])
        self.sizes = sorted({size for size in sizes if 0 < size <= limit})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        model.precompute_and_store_context_kv = self.store

    def slots(self, num_tokens: int):
        """The slot mappings of the first ``num_tokens`` tokens, shaped as stock passes them."""
        if self.layer_rows is None:
            return self.slot_rows[0, :num_tokens]
        return [self.slot_rows[row, :num_tokens] for row in self.layer_rows]

    def capture(self, pool) -> None:
        """One graph per size, largest first so that smaller ones reuse its pool memory.
        The store runs no collective (under tensor parallelism each rank projects its own
        K/V heads), so none of vLLM's collective capture contexts is needed."""
        self.slot_rows.fill_(PAD_SLOT_ID)  # warm-up and capture write nothing
        for size in reversed(self.sizes):
            args = (self.states[:size], self.positions[:size], self.slots(size))
            self._eager(*args)  # lazy initialisation outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._eager(*args)
            self.graphs[size] = graph

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size that replays ``num_tokens`` tokens, None if there is none."""
        index = bisect_left(self.sizes, num_tokens)
        if not self.graphs or index == len(self.sizes):
            return None
        return self.sizes[index]

    def store(self, states, positions, slots=None) -> None:
        """The drafter's ``precompute_and_store_context_kv``: a replay when the arguments
        are the first rows of the captured buffers, else the eager store."""
        num_tokens = states.shape[0]
        size = self.bucket(num_tokens)
        if size is None or not self._on_buffers(states, positions, slots):
            return self._eager(states, positions, slots)
        self.slot_rows[:, num_tokens:size].fill_(PAD_SLOT_ID)
        self.graphs[size].replay()
        return None

    def _on_buffers(self, states, positions, slots) -> bool:
        if slots is None:  # a dummy run: compute only, write nothing
            return False
        one_mapping = isinstance(slots, torch.Tensor)
        if one_mapping != (self.layer_rows is None):
            return False
        given = [slots] if one_mapping else list(slots)
        if len(given) != len(self._slot_ptrs) or any(s is None for s in given):
            return False
        return (states.data_ptr(), positions.data_ptr()) == self._buffer_ptrs and [
            s.data_ptr() for s in given
        ] == self._slot_ptrs


class GraphedContextKV:
    """Mixin for vllm-dspark's DFlash-family speculators: the context-K/V store replays
    :class:`ContextKVGraphs`, captured after the speculator's own draft graphs. With
    ``dspark_fp8_draft_backbone`` the drafter's layers go to FP8 once it has loaded, after
    its context-K/V projection is built from the bf16 weights."""

    def load_draft_model(self, target_model, target_attn_layer_names):
        model = super().load_draft_model(target_model, target_attn_layer_names)
        if self.options.fp8_draft_backbone:
            quantize_draft_backbone(model)
        return model

    def set_attn(self, *args, **kwargs) -> None:
        super().set_attn(*args, **kwargs)
        self.context_kv = ContextKVGraphs(
            self.model,
            self.hidden_states,
            self.context_positions,
            self._context_slot_mappings,
            self._layer_group_idx,
            self.vllm_config.compilation_config.cudagraph_capture_sizes or (),
        )

    def capture_context_kv(self, pool) -> None:
        if pool is not None:  # None: CUDA graphs are off, the store stays eager
            self.context_kv.capture(pool)
