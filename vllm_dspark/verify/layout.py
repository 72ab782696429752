"""A decode step's verification batch laid out for what capacity control admits.

The runner patches (:mod:`vllm_dspark.patches.compact_verification`) call these on vLLM's
own runner and batch: :func:`step_facts` reads the scheduled step on the host,
:func:`compact_input_batch` rewrites the stock batch to the compact layout of
:mod:`vllm_dspark.verify.compaction` (on a GPU with one Triton kernel), and
:func:`masked_input_batch` keeps the uniform forward and rewrites only what is verified.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.worker.gpu.buffer_utils import async_copy_to_gpu

from vllm_dspark.capacity.controller import StepFacts, StepPlan
from vllm_dspark.triton_path import use_triton
from vllm_dspark.verify.compaction import compact_layout, compact_seq_lens, compact_tokens
from vllm_dspark.verify.compaction_kernel import compact_on_device


def step_facts(runner, scheduler_output) -> StepFacts:
    """What the controller plans a scheduled step from."""
    counts = scheduler_output.num_scheduled_tokens
    plain_steps = runner.speculator.options.plain_steps
    return StepFacts(
        num_reqs=len(counts),
        num_tokens=scheduler_output.total_num_scheduled_tokens,
        num_drafting=len(scheduler_output.scheduled_spec_decode_tokens),
        # Read only where plain steps are on: the controller times plain steps apart.
        plain_decode=plain_steps and is_plain_decode(scheduler_output),
        next_step_drafts=scheduler_output.num_spec_tokens_to_schedule,
        count_decoding=lambda: count_decoding(runner, scheduler_output),
    )


def count_decoding(runner, scheduler_output) -> int | None:
    """How many requests of a step decode with their K drafts, when the step can be
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
    return len(decoding)


def _wants_logprobs(new_request) -> bool:
    """Whether a new request asks for logprobs of any kind (what the sampler's
    ``returns_logprobs`` reads once it holds the request)."""
    params = getattr(new_request, "sampling_params", None)
    return params is not None and (
        params.logprobs is not None
        or params.prompt_logprobs is not None
        or bool(params.logprob_token_ids)
    )


def is_plain_decode(scheduler_output) -> bool:
    """One token per running request and no draft: a step the scheduler gave no drafts."""
    counts = scheduler_output.num_scheduled_tokens
    return (
        bool(counts)
        and not scheduler_output.scheduled_new_reqs
        and not any(scheduler_output.scheduled_spec_decode_tokens.values())
        and all(n == 1 for n in counts.values())
    )


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


def admit(runner, batch, budget: int, from_graph: bool, decodes: int | None = None):
    """k_r of each decoding request of the step (the first ``decodes``; all when None),
    from the controller; the emit room only where the budget is split by survival."""
    controller = runner.speculator.controller
    decodes = batch.num_reqs if decodes is None else decodes
    room = emit_room(runner, batch)[:decodes] if controller.splits_by_survival else None
    mixed = decodes < batch.num_reqs
    return controller.admit_step(
        batch.req_ids[:decodes], batch.idx_mapping[:decodes], budget, room, from_graph, mixed
    )


def compact_input_batch(runner, batch, plan: StepPlan, from_graph: bool = False):
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
    num_reqs, buffers, budget = batch.num_reqs, runner.input_buffers, plan.budget
    decodes, num_tokens = plan.mixed or (num_reqs, num_reqs + budget)
    capacity = admit(runner, batch, budget, from_graph, decodes)
    if plan.mixed is None and use_triton(buffers.input_ids):
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
    return _verifying(
        batch,
        budget,
        num_tokens=num_tokens,
        expanded_idx_mapping=expanded_idx,
        expanded_local_pos=local_pos,
        logits_indices=logits_indices,
        cu_num_logits=cu_num_logits,
    )


def masked_input_batch(runner, batch, plan: StepPlan, from_graph: bool = False):
    """``dspark_varlen_verify=false``: the stock uniform batch, whose forward runs every
    draft, with only the admitted ones verified (the logits of each request's first
    1 + k_r tokens, and the rejection sampler's per-request draft counts, rewritten on the
    GPU). What the target computed for the other K - k_r drafts of request r is dropped as
    a rejection would drop it (the controller holds them until the step's sampling counts
    them rejected). For attention backends that cannot take a compacted batch; it saves
    the verification's sampling work, not its forward."""
    controller = runner.speculator.controller
    capacity = admit(runner, batch, plan.budget, from_graph)
    num_drafts = controller.num_speculative_steps
    layout = compact_layout(capacity, num_drafts, batch.num_reqs + plan.budget)
    controller.hold_masked_drafts(layout.dropped)
    return _verifying(
        batch,
        plan.budget,
        expanded_idx_mapping=batch.idx_mapping[layout.request],
        expanded_local_pos=layout.offset.to(torch.int32),
        logits_indices=batch.logits_indices[layout.source],
        cu_num_logits=layout.query_start_loc,
    )


def _verifying(batch, budget: int, **layout):
    """``batch`` verifying ``budget`` admitted drafts, laid out by ``layout``'s fields."""
    return dataclasses.replace(
        batch,
        num_draft_tokens=budget,
        # Per-request counts live on the GPU now; the host keeps only upper bounds.
        num_draft_tokens_per_req=None,
        **layout,
    )
