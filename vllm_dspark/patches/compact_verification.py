"""Verify only the drafts capacity control admits, packed without padding.

What: wraps four names of vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner``):
``GPUModelRunner.execute_model``, where the step's admission budget B is decided on the
host; ``dispatch_cg_and_sync_dp``, which picks the CUDA graph from the step's token count;
``GPUModelRunner.prepare_inputs``; and ``GPUModelRunner.sample`` (masked steps, below);
two of ``vllm.v1.worker.gpu.cudagraph_utils``:
``ModelCudaGraphManager._init_candidates``, which lists the target's graphs to capture, and
``CudaGraphManager.capture``, which captures them; and ``InputBatch.make_dummy``, whose
dummy batch a compact graph is captured on with queries of up to 1 + K tokens
(:func:`vllm_dspark.verify.compact_graphs.capture_query_lengths`). In a
decode-only step (every request with its K drafts) of a runner whose speculator controls
capacity, the dispatch is asked for the compact R + B tokens instead of R * (1 + K) and
replays the smallest FULL variable-length graph that holds them
(:mod:`vllm_dspark.verify.compact_graphs`; captured beside vLLM's own when its cudagraph
mode has FULL decode graphs, data parallelism is off and every attention layer runs
FlashAttention 3, else vLLM's mixed-batch dispatch applies); after the stock input
preparation the batch is rewritten on the GPU to the compact layout of
:mod:`vllm_dspark.verify.compaction` (input ids, positions, query offsets, sequence lengths,
logits indices and the rejection sampler's per-request draft counts). The target's attention
must build its metadata from device-side query offsets (FlashAttention or Triton attention;
start-up refuses others). The slot mappings and attention metadata are then derived by vLLM
from the compact batch as usual. In steps with prefills (unless ``dspark_mixed_steps``
is false: then all K drafts) the decoding requests, which vLLM sorts first, are
compacted as above and every prompt's tokens move up by the drafts dropped
(:func:`compact_input_batch`). Steps with structured output or logprobs run unchanged,
which is always lossless, and so do steps that admit all K.
Runners whose speculator has no capacity control are untouched: the wrappers find no
budget and call vLLM's code. With ``dspark_varlen_verify=false`` a step is masked instead
(:func:`masked_input_batch`): its uniform forward and graph stay vLLM's, only the logits
verified and the per-request draft counts are rewritten, and its sampling counts the
drafts not verified as rejected; any attention backend takes it.
Why: vLLM 0.26.0 verifies every scheduled draft; under load the verification of
drafts that will be rejected costs more than speculation gains.
Upstream: vllm-project/vllm#47808 (adaptive verification) does this in-tree, in vLLM
releases after 0.26.0.
Remove when: the pinned vLLM verifies a device-chosen subset of drafts itself.
Applied lazily, by :mod:`vllm_dspark.patches.speculator_selection`, only when a
speculator with capacity control is built.
"""

from __future__ import annotations

import dataclasses
import sys
from contextvars import ContextVar

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.buffer_utils import async_copy_to_gpu

from vllm_dspark.patches.wrapping import ORIGINAL_ATTR, wrap
from vllm_dspark.triton_path import use_triton
from vllm_dspark.verify.compact_graphs import (
    capture_query_lengths,
    compact_graph_descriptors,
    pick_compact_graph,
    replays_varlen_graphs,
)
from vllm_dspark.verify.compaction import compact_layout, compact_seq_lens, compact_tokens
from vllm_dspark.verify.compaction_kernel import compact_on_device

RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
GRAPHS_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
BATCH_MODULE = "vllm.v1.worker.gpu.input_batch"
# Set on the target's graph manager: its FULL variable-length descriptors, smallest first.
COMPACT_GRAPHS_ATTR = "dspark_compact_graphs"
# The admission budget of the step ``execute_model`` is running, if it is compacted.
_step_budget_var: ContextVar[int | None] = ContextVar("vllm_dspark_step_budget", default=None)
# ... and in a step that also carries prompts: (its decoding requests, which lead the
# batch, and its tokens once compacted).
_mixed_step_var: ContextVar[tuple[int, int] | None] = ContextVar(
    "vllm_dspark_mixed_step", default=None
)
# ... if it is verified masked instead (dspark_varlen_verify=false): uncompacted.
_step_mask_var: ContextVar[int | None] = ContextVar("vllm_dspark_step_mask", default=None)
# While a compact graph's inputs are prepared for capture: its longest query (1 + K).
_capture_query_len_var: ContextVar[int | None] = ContextVar(
    "vllm_dspark_capture_query_len", default=None
)


def _decoding_requests(runner, scheduler_output) -> list[str] | None:
    """The requests of a step that decode with their K drafts, when the step can be
    compacted: every request decodes, or (mixed steps) every other one carries
    a prompt and no draft. None otherwise (all K drafts are verified)."""
    speculator = runner.speculator
    num_drafts = speculator.num_speculative_steps
    counts = scheduler_output.num_scheduled_tokens
    if not counts or scheduler_output.has_structured_output_requests:
        return None
    drafts = scheduler_output.scheduled_spec_decode_tokens
    # New (or resumed) requests are not in the runner's slots yet, and vLLM pads one with
    # a single token left to decode-shaped 1 + K: its drafts were never proposed.
    new = {getattr(req, "req_id", req) for req in scheduler_output.scheduled_new_reqs}
    decoding = [
        req_id
        for req_id, n in counts.items()
        if n == 1 + num_drafts and len(drafts.get(req_id, ())) == num_drafts and req_id not in new
    ]
    if not decoding:
        return None
    if len(decoding) < len(counts):
        if not speculator.options.compacts_mixed_steps:
            return None
        leading = set(decoding)
        prompts = [req_id for req_id in counts if req_id not in leading]
        # Compacted, the decoding requests must lead the batch: vLLM sorts the requests
        # of 1 + K tokens first, so no other may have that many; none may draft.
        if any(drafts.get(req_id) or counts[req_id] == 1 + num_drafts for req_id in prompts):
            return None
        # Logprobs are laid out per request on the host (a new request's too).
        if any(_wants_logprobs(req) for req in scheduler_output.scheduled_new_reqs):
            return None
    old = [req_id for req_id in counts if req_id not in new]
    slots = np.fromiter(map(runner.req_states.req_id_to_index.get, old), dtype=np.int32)
    if runner.sampler.returns_logprobs(slots):
        return None
    return decoding


def _wants_logprobs(new_request) -> bool:
    """Whether a new request asks for logprobs of any kind (what the sampler's
    ``returns_logprobs`` reads once it holds the request)."""
    params = getattr(new_request, "sampling_params", None)
    return params is not None and (
        params.logprobs is not None
        or params.prompt_logprobs is not None
        or bool(params.logprob_token_ids)
    )


@dataclasses.dataclass(frozen=True)
class StepBudget:
    drafts: int  # B, the drafts the step verifies
    # In a step that also carries prompts: (its decoding requests, which lead the batch,
    # and its tokens once compacted); None in a decode-only step.
    mixed: tuple[int, int] | None = None


def _step_budget(runner, scheduler_output) -> StepBudget | None:
    """B for a step that can be compacted, else None (all K drafts are verified)."""
    speculator = runner.speculator
    if speculator.resting:
        # sps at rest (capacity/rest.py): vLLM's own step, its requests not sorted out.
        speculator.record_full_admission(len(scheduler_output.scheduled_spec_decode_tokens))
        return None
    decoding = _decoding_requests(runner, scheduler_output)
    if decoding is None:
        return None
    num_drafts = speculator.num_speculative_steps
    mixed = len(decoding) < len(scheduler_output.num_scheduled_tokens)
    budget = speculator.admission_budget(len(decoding), vary=not mixed)
    if not mixed:  # what the step verifies, for sps (a step with prompts is off its curve)
        speculator.step_tokens = len(decoding) + budget
    if budget == len(decoding) * num_drafts:
        # Every draft admitted: compaction would be the identity. vLLM's own step (and
        # its uniform-decode graph) runs the same tokens with less host work.
        speculator.record_full_admission(len(decoding))
        return None
    if not mixed:
        return StepBudget(budget)
    dropped = len(decoding) * num_drafts - budget
    return StepBudget(
        budget, (len(decoding), scheduler_output.total_num_scheduled_tokens - dropped)
    )


def _is_plain_decode(scheduler_output) -> bool:
    """One token per running request and no draft: a step the scheduler gave no drafts."""
    counts = scheduler_output.num_scheduled_tokens
    return (
        bool(counts)
        and not scheduler_output.scheduled_new_reqs
        and not any(scheduler_output.scheduled_spec_decode_tokens.values())
        and all(n == 1 for n in counts.values())
    )


def _make_execute_wrapper(execute_model):
    def execute_model_with_compaction(self, scheduler_output, *args, **kwargs):
        if not getattr(self.speculator, "controls_capacity", False) or kwargs.get("dummy_run"):
            return execute_model(self, scheduler_output, *args, **kwargs)
        # Whether the step after this one verifies drafts (capacity/plain_steps.py).
        self.speculator.next_step_drafts = scheduler_output.num_spec_tokens_to_schedule
        if self.speculator.options.plain_steps and _is_plain_decode(scheduler_output):
            # Timed apart: the draft gate weighs drafting against this step's cost.
            self.speculator.step_tokens = len(scheduler_output.num_scheduled_tokens)
            self.speculator.step_plain = True
        step = _step_budget(self, scheduler_output)
        budget = None if step is None else step.drafts
        masked_drafts = self.speculator.masked_step_drafts
        masked = budget is not None and masked_drafts > 0
        if masked:  # the target runs every draft: what the step's forward costs
            num_reqs = len(scheduler_output.num_scheduled_tokens)
            self.speculator.step_tokens = num_reqs * (1 + masked_drafts)
        # Timed apart from vLLM's own steps: the compaction premium (capacity/step_overhead.py).
        self.speculator.step_compacted = budget is not None and not masked and step.mixed is None
        token = _step_budget_var.set(None if masked else budget)
        mask_token = _step_mask_var.set(budget if masked else None)
        mixed_token = _mixed_step_var.set(None if step is None or masked else step.mixed)
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            _step_budget_var.reset(token)
            _step_mask_var.reset(mask_token)
            _mixed_step_var.reset(mixed_token)

    return execute_model_with_compaction


def _make_dispatch_wrapper(dispatch):
    def dispatch_with_compaction(manager, num_reqs, num_tokens, uniform_token_count, *args, **kw):
        budget = _step_budget_var.get()
        if budget is None:
            return dispatch(manager, num_reqs, num_tokens, uniform_token_count, *args, **kw)
        mixed = _mixed_step_var.get()
        if mixed is not None:  # prompts too: vLLM's mixed-batch dispatch, fewer tokens
            return dispatch(manager, num_reqs, mixed[1], None, *args, **kw)
        num_tokens = num_reqs + budget
        if not kw.get("need_eager") and not kw.get("num_active_loras"):
            graph = pick_compact_graph(
                getattr(manager, COMPACT_GRAPHS_ATTR, ()), manager.graphs, num_reqs, num_tokens
            )
            if graph is not None:
                return graph, None  # captured only without data parallelism: no DP sync
        # Mixed-length queries: no uniform-decode graph applies.
        return dispatch(manager, num_reqs, num_tokens, None, *args, **kw)

    return dispatch_with_compaction


def _make_candidates_wrapper(init_candidates):
    def init_candidates_with_compact_graphs(manager):
        init_candidates(manager)
        sizes = manager.compilation_config.cudagraph_capture_sizes
        if (
            manager.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL
            or manager.dp_size > 1
            or manager.decode_query_len < 2
            or not sizes
            or not replays_varlen_graphs(manager.vllm_config)
        ):
            return
        compact = compact_graph_descriptors(
            sizes,
            manager.max_num_reqs,
            manager.decode_query_len - 1,
            manager.compilation_config.max_cudagraph_capture_size,
        )
        full = manager._capture_descs.setdefault(CUDAGraphMode.FULL, [])
        full += [desc for desc in compact if desc not in full]
        full.sort(key=lambda desc: desc.num_tokens, reverse=True)  # vLLM's capture order
        setattr(manager, COMPACT_GRAPHS_ATTR, compact)

    return init_candidates_with_compact_graphs


def _make_capture_wrapper(capture):
    def capture_with_decode_queries(manager, create_forward_fn, *args, **kwargs):
        compact = getattr(manager, COMPACT_GRAPHS_ATTR, ())
        if not compact:
            return capture(manager, create_forward_fn, *args, **kwargs)

        def create_forward_fn_for(desc, warmup):
            query_len = manager.decode_query_len if desc in compact else None
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


def emit_room(runner, batch) -> torch.Tensor:
    """Per request of a uniform decode step, how many of its K drafts it could still use:
    its length may not pass prompt + max_tokens (vLLM's ``max_seq_len``), and a step
    emits the accepted drafts plus one token. A request that the step before has already
    finished (async scheduling plans a step before the last one's accepted tokens are
    known) has none. Read from the stock batch's sequence lengths, num_computed + 1 + K on
    the device (the last step's acceptance included), before they are compacted; known
    before the drafts are verified, so admitting by it stays lossless."""
    num_drafts = runner.speculator.num_speculative_steps
    seq_lens = runner.input_buffers.seq_lens[: batch.num_reqs]
    max_len = torch.from_numpy(runner.req_states.max_seq_len[batch.idx_mapping_np])
    if seq_lens.is_cuda:  # through pinned memory: a pageable copy would wait for the stream
        max_len = async_copy_to_gpu(max_len, device=seq_lens.device)
    return (max_len - seq_lens + num_drafts - 1).clamp(min=0)


def step_capacity(runner, batch, budget: int, decodes: int | None = None) -> torch.Tensor:
    """k_r of each decoding request of the step (the first ``decodes``; all when None)
    (:meth:`CapacityControl.verify_capacity`); the emit room only where the budget is split
    by survival (``acceptance`` verifies one depth for all and would discard it)."""
    speculator = runner.speculator
    rows = slice(decodes)
    room = None if speculator.acceptance is not None else emit_room(runner, batch)[rows]
    return speculator.verify_capacity(batch.idx_mapping[rows], budget, room)


def compact_input_batch(runner, batch, budget: int, from_graph: bool = False):
    """The stock batch rewritten to its compact layout (``from_graph``: the step replays a
    FULL graph, counted for the metrics): each decoding request keeps 1 + k_r tokens,
    R + budget in a decode-only step. In a step that also carries prompts the
    decoding requests lead the batch (vLLM sorts the requests
    of 1 + K tokens first) and every later request's tokens (a prompt chunk, no drafts,
    one logit at its last token) move up by the drafts dropped; its token count is known
    on the host. On a GPU one Triton kernel writes a decode-only step; elsewhere, and for
    steps with prompts (which replay no FULL graph), the PyTorch layout of
    :mod:`vllm_dspark.verify.compaction` does."""
    speculator = runner.speculator
    num_drafts = speculator.num_speculative_steps
    num_reqs, buffers = batch.num_reqs, runner.input_buffers
    mixed = _mixed_step_var.get()
    decodes, num_tokens = mixed or (num_reqs, num_reqs + budget)
    capacity = step_capacity(runner, batch, budget, decodes)
    if mixed is None and use_triton(buffers.input_ids):
        expanded_idx, local_pos, logits_indices = compact_on_device(
            capacity,
            num_drafts,
            num_tokens,
            batch.idx_mapping,
            buffers.input_ids,
            buffers.positions,
            buffers.query_start_loc,
            buffers.seq_lens,
            speculator.max_num_reqs,
        )
        cu_num_logits = buffers.query_start_loc[: num_reqs + 1].clone()
    else:
        layout = compact_layout(capacity, num_drafts, decodes + budget)
        uniform = decodes * (1 + num_drafts)  # the decoding requests' tokens, uncompacted
        shift = uniform - (decodes + budget)  # the drafts dropped
        device = layout.source.device
        # Gathered first, then written back: source and destination overlap.
        for values in (buffers.input_ids, buffers.positions):
            kept = [compact_tokens(values[:uniform], layout), values[uniform : num_tokens + shift]]
            values[:num_tokens].copy_(torch.cat(kept))
        query_start_loc = buffers.query_start_loc
        query_start_loc[decodes + 1 : num_reqs + 1] -= shift
        query_start_loc[: decodes + 1].copy_(layout.query_start_loc)
        query_start_loc[num_reqs + 1 :].fill_(num_tokens)  # non-decreasing padding
        seq_lens = buffers.seq_lens[:decodes]
        seq_lens.copy_(compact_seq_lens(seq_lens, layout))
        # One logit per prompt request (vLLM's, at its last token), after the decoding ones.
        prompts = torch.arange(1, num_reqs - decodes + 1, device=device)
        cu_num_logits = torch.cat([layout.query_start_loc, decodes + budget + prompts])
        cu_num_logits = cu_num_logits.to(torch.int32)
        logits_indices = torch.cat(
            [torch.arange(decodes + budget, device=device), batch.logits_indices[uniform:] - shift]
        )
        expanded_idx = torch.cat(
            [batch.idx_mapping[:decodes][layout.request], batch.idx_mapping[decodes:]]
        )
        local_pos = torch.cat([layout.offset, torch.zeros_like(prompts)]).to(torch.int32)
    return _admitted_batch(
        speculator,
        batch,
        budget,
        from_graph,
        capacity,
        decodes,
        num_tokens=num_tokens,
        expanded_idx_mapping=expanded_idx,
        expanded_local_pos=local_pos,
        logits_indices=logits_indices,
        cu_num_logits=cu_num_logits,
    )


def masked_input_batch(runner, batch, budget: int, from_graph: bool = False):
    """``dspark_varlen_verify=false``: the stock uniform batch, whose forward runs every
    draft, with only the admitted ones verified (the logits of each request's first
    1 + k_r tokens, and the rejection sampler's per-request draft counts, rewritten on the
    GPU). What the target computed for the other K - k_r drafts of request r is dropped as
    a rejection would drop it (:func:`_make_sample_wrapper`). For attention backends that
    cannot take a compacted batch; it saves the verification's sampling work, not its
    forward."""
    speculator = runner.speculator
    capacity = step_capacity(runner, batch, budget)
    layout = compact_layout(capacity, speculator.num_speculative_steps, batch.num_reqs + budget)
    speculator.masked_drafts = layout.dropped
    return _admitted_batch(
        speculator,
        batch,
        budget,
        from_graph,
        capacity,
        batch.num_reqs,
        expanded_idx_mapping=batch.idx_mapping[layout.request],
        expanded_local_pos=layout.offset.to(torch.int32),
        logits_indices=batch.logits_indices[layout.source],
        cu_num_logits=layout.query_start_loc,
    )


def _admitted_batch(
    speculator, batch, budget: int, from_graph: bool, capacity, decodes: int, **layout
):
    """``batch`` verifying ``budget`` admitted drafts (k_r: ``capacity``, of its first
    ``decodes`` requests; the others carry prompts) in ``layout``'s fields, its admission
    recorded for the metrics."""
    mixed = decodes < batch.num_reqs
    speculator.record_admission(batch.req_ids[:decodes], budget, from_graph, capacity, mixed)
    return dataclasses.replace(
        batch,
        num_draft_tokens=budget,
        # Per-request counts live on the GPU now; the host keeps only upper bounds.
        num_draft_tokens_per_req=None,
        **layout,
    )


def _make_prepare_wrapper(prepare_inputs):
    def prepare_inputs_with_compaction(self, scheduler_output, batch_desc):
        batch = prepare_inputs(self, scheduler_output, batch_desc)
        from_graph = batch_desc.cg_mode == CUDAGraphMode.FULL
        budget = _step_budget_var.get()
        if budget is not None:
            return compact_input_batch(self, batch, budget, from_graph)
        masked = _step_mask_var.get()
        if masked is not None:
            return masked_input_batch(self, batch, masked, from_graph)
        return batch

    return prepare_inputs_with_compaction


def _make_sample_wrapper(sample):
    def sample_with_masked_drafts(self, *args, **kwargs):
        sampler_output, num_sampled, num_rejected = sample(self, *args, **kwargs)
        masked = getattr(self.speculator, "masked_drafts", None)
        if masked is None:
            return sampler_output, num_sampled, num_rejected
        # The drafts a masked step ran but did not verify count as rejected: the request's
        # computed tokens and the drafter's context end at its last accepted draft.
        self.speculator.masked_drafts = None
        return sampler_output, num_sampled, num_rejected + masked.to(num_rejected.dtype)

    return sample_with_masked_drafts


def is_applied() -> bool:
    runner_module = sys.modules.get(RUNNER_MODULE)
    return runner_module is not None and hasattr(
        runner_module.GPUModelRunner.execute_model, ORIGINAL_ATTR
    )


def apply() -> None:
    runner_module = sys.modules[RUNNER_MODULE]
    runner = runner_module.GPUModelRunner
    wrap(runner, "execute_model", _make_execute_wrapper)
    wrap(runner_module, "dispatch_cg_and_sync_dp", _make_dispatch_wrapper)
    wrap(runner, "prepare_inputs", _make_prepare_wrapper)
    wrap(runner, "sample", _make_sample_wrapper)
    graphs_module = sys.modules[GRAPHS_MODULE]
    wrap(graphs_module.ModelCudaGraphManager, "_init_candidates", _make_candidates_wrapper)
    wrap(graphs_module.CudaGraphManager, "capture", _make_capture_wrapper)
    wrap(sys.modules[BATCH_MODULE].InputBatch, "make_dummy", _make_dummy_batch_wrapper)
