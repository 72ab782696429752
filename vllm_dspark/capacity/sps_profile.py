"""The target's steps per second against tokens per step (the SPS curve), timed in the
worker from the runner's own decode path.

For every FULL decode CUDA graph the runner captured (R requests, T tokens in all), dummy
decode steps go through ``execute_model`` as vLLM's warm-up runs do, plus the LM head over
the T tokens as verification computes it; CUDA events around ``repeats`` back-to-back steps
time one step, and the median of ``rounds`` such groups is kept. Dummy requests attend only
their own query tokens, so the curve measures the weight-bound cost that dominates decode.
Their tokens are random ids, not vLLM's zeros (:func:`distinct_dummy_tokens`), so that a
MoE layer routes them over its experts as it routes a decode step's.
Past the largest graph the same steps run without a graph, as real ones do there
(:func:`eager_decode_shapes`), rather than extrapolating the last graph's rate, which made
such steps look cheap. :func:`time_draft_graphs` times a speculator's captured draft graphs
per batch size: what a proposal costs, for deciding whether drafting pays at all.
"""

from __future__ import annotations

import contextlib
import statistics

import torch


def decode_graph_shapes(runner) -> list[tuple[int, int]]:
    """(tokens, requests) of each captured FULL uniform-decode graph, smallest first."""
    from vllm.config.compilation import CUDAGraphMode

    manager = runner.cudagraph_manager
    if manager is None:
        return []
    return sorted(
        {
            (desc.num_tokens, desc.num_reqs)
            for desc in manager.graphs
            if desc.cg_mode == CUDAGraphMode.FULL
            and desc.uniform_token_count == runner.decode_query_len
        }
    )


def eager_decode_shapes(runner, graph_shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(tokens, requests) of uniform decode steps past the largest of ``graph_shapes``
    (the captured ones, smallest first), which run without a graph: one request more than
    it, twice and four times its requests, and the most requests a decode step can hold
    (``max_num_seqs``, and ``max_num_batched_tokens`` over the decode query length) if
    that is not more. No further: each timed step computes the LM head's logits for all
    its tokens (at 8,192 tokens of a 152k vocabulary, 2.5 GB), which vLLM's memory
    profile may not have set aside, and far past the graphs a step is compute-bound,
    where the table holds tokens per second anyway."""
    if not graph_shapes:
        return []
    query_len = runner.decode_query_len
    largest = graph_shapes[-1][1]
    most = min(runner.max_num_reqs, runner.max_num_tokens // query_len, 4 * largest)
    candidates = {largest + 1, 2 * largest, 4 * largest, most}
    return [(r * query_len, r) for r in sorted(candidates) if largest < r <= most]


def _dummy_decode(num_tokens: int, num_reqs: int):
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.total_num_scheduled_tokens = num_tokens
    output.num_scheduled_tokens = {f"_sps_{i}": num_tokens // num_reqs for i in range(num_reqs)}
    return output


@contextlib.contextmanager
def distinct_dummy_tokens(vocab_size: int, seed: int = 0):
    """While open, vLLM's dummy batches (``InputBatch.make_dummy``) carry random token ids
    below ``vocab_size`` (seeded, drawn on the batch's device) where vLLM gives every query
    token 0. Identical tokens take one route through a MoE layer: a few experts' weights
    are read where a decode step of distinct tokens reads nearly all, so a curve timed on
    them makes every step look cheaper, the more so the fewer its tokens, and sps would
    compact steps that save nothing. Dense layers cost the same either way."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    stock = InputBatch.__dict__["make_dummy"]
    generators: dict[torch.device, torch.Generator] = {}

    def make_dummy(cls, *args, **kwargs):
        batch = stock.__func__(cls, *args, **kwargs)
        device = batch.input_ids.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        batch.input_ids.random_(0, vocab_size, generator=generators[device])
        return batch

    InputBatch.make_dummy = classmethod(make_dummy)
    try:
        yield
    finally:
        InputBatch.make_dummy = stock


def _decode_step(runner, scheduled, num_tokens: int) -> None:
    runner.execute_model(scheduled, dummy_run=True)
    hidden = runner.execute_model_state.hidden_states
    runner.execute_model_state = None
    runner.model.compute_logits(hidden[:num_tokens])


@torch.inference_mode()
def time_target_steps(
    runner, warmup: int = 3, repeats: int = 10, rounds: int = 3, eager_repeats: int = 3
) -> list[tuple[int, float]]:
    """[(T, median ms per target step)] for every captured decode graph of the runner, then
    for the decode steps past the largest one (``eager_repeats`` steps per group: each
    takes tens of milliseconds); none without a captured graph (``auto`` then refuses)."""
    graphs = decode_graph_shapes(runner)
    shapes = [(*shape, repeats) for shape in graphs]
    shapes += [(*shape, eager_repeats) for shape in eager_decode_shapes(runner, graphs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    runner.kv_connector.set_disabled(True)
    try:
        with distinct_dummy_tokens(runner.vocab_size):
            for num_tokens, num_reqs, group in shapes:
                scheduled = _dummy_decode(num_tokens, num_reqs)
                for _ in range(warmup):
                    _decode_step(runner, scheduled, num_tokens)
                times = []
                for _ in range(rounds):
                    start.record()
                    for _ in range(group):
                        _decode_step(runner, scheduled, num_tokens)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / group)
                rows.append((num_tokens, statistics.median(times)))
    finally:
        runner.kv_connector.set_disabled(False)
    return rows


@torch.inference_mode()
def time_draft_graphs(
    speculator, manager=None, warmup: int = 3, repeats: int = 10
) -> list[tuple[int, float]]:
    """[(requests, median ms)] of every FULL graph a draft graph manager (by default the
    speculator's own) captured. Before a graph's replays, the dummy batch it was captured
    for is prepared again as vLLM's capture prepares it (inputs, slot mappings that write
    nowhere, attention metadata): FlashAttention keeps its tile schedule in a persistent
    buffer that the last capture left laid out for the smallest batch, so replaying the
    other graphs without this would time less work than they do. Its tokens are random ids
    (:func:`distinct_dummy_tokens`), as a MoE drafter's layers must route them."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import (
        _prepare_dflash_inputs_to_capture,
    )

    manager = manager or speculator.query_cudagraph_manager
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    descs = [desc for desc in manager.graphs if desc.cg_mode == CUDAGraphMode.FULL]
    for desc in sorted(descs, key=lambda desc: desc.num_reqs):
        with distinct_dummy_tokens(speculator.vocab_size):
            _prepare_dflash_inputs_to_capture(
                desc.num_reqs,
                desc.num_tokens,
                speculator.input_buffers,
                speculator.block_tables,
                speculator.attn_groups,
                speculator.kv_cache_config,
                speculator.max_model_len,
                skip_attn=False,
                causal=speculator._group_causal,
            )
        graph = manager.graphs[desc]
        for _ in range(warmup):
            graph.replay()
        times = []
        for _ in range(repeats):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rows.append((desc.num_reqs, statistics.median(times)))
    return rows


def curve_from_times(rows: list[tuple[int, float]]) -> list[list[float]]:
    """[[T, steps per second]] from [(T, ms per step)]."""
    return [[tokens, round(1000.0 / ms, 2)] for tokens, ms in rows]
