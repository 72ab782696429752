"""One Triton kernel for the compact rewrite of a uniform verification batch.

:func:`vllm_dspark.verify.compaction.compact_layout` says what the compact layout is, in
PyTorch; built that way on the GPU it is ~30 small kernel launches, each a few microseconds
of host time, on every compacted step, which are host-bound. This kernel writes the same
result in one launch: one program per request r reads every request's admitted count k,
sums the lengths 1 + k of the requests before r (its first compact token; R is at most
max_num_seqs, so each program's sum is cheap), and copies its 1 + k_r tokens (input ids,
positions) from a snapshot of the uniform layout, with their request slot, offset within the
query and logits index, its query end and its shortened sequence length; program 0 also
writes query offset 0 and the non-decreasing padding of the offsets past R. The CPU path and
the tests use the PyTorch layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Sizes as plain arguments (one compiled kernel whatever the batch); the block over the
# requests is fixed per engine by max_num_seqs.
@triton.jit(do_not_specialize=["num_reqs", "query_start_loc_len"])
def _compact_kernel(
    capacity_ptr,  # [R] admitted drafts per request
    uniform_ids_ptr,  # [R * (1 + K)] snapshot of the uniform input ids
    uniform_pos_ptr,  # [R * (1 + K)] snapshot of the uniform positions
    idx_mapping_ptr,  # [R] request slot of each batch row
    input_ids_ptr,  # out: compact input ids (the runner's buffer)
    positions_ptr,  # out: compact positions (the runner's buffer)
    query_start_loc_ptr,  # out: [query_start_loc_len] compact query offsets
    seq_lens_ptr,  # in/out: [R] sequence lengths, shortened by the dropped drafts
    expanded_idx_ptr,  # out: [T] request slot of each compact token
    local_pos_ptr,  # out: [T] offset of each compact token within its query
    logits_idx_ptr,  # out: [T] logits index of each compact token
    num_reqs,
    query_start_loc_len,
    NUM_DRAFTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    r = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    caps = tl.load(capacity_ptr + rows, mask=rows < num_reqs, other=0).to(tl.int32)
    lengths = tl.where(rows < num_reqs, caps + 1, 0)
    start = tl.sum(tl.where(rows < r, lengths, 0), axis=0)
    k = tl.load(capacity_ptr + r).to(tl.int32)

    j = tl.arange(0, BLOCK_Q)
    keep = j <= k
    src = r * (1 + NUM_DRAFTS) + j
    dst = start + j
    tl.store(input_ids_ptr + dst, tl.load(uniform_ids_ptr + src, mask=keep), mask=keep)
    tl.store(positions_ptr + dst, tl.load(uniform_pos_ptr + src, mask=keep), mask=keep)
    slot = tl.load(idx_mapping_ptr + r)
    tl.store(expanded_idx_ptr + dst, tl.zeros_like(j) + slot, mask=keep)
    tl.store(local_pos_ptr + dst, j, mask=keep)
    tl.store(logits_idx_ptr + dst, dst.to(tl.int64), mask=keep)

    tl.store(query_start_loc_ptr + r + 1, start + 1 + k)
    seq_len = tl.load(seq_lens_ptr + r)
    tl.store(seq_lens_ptr + r, seq_len - (NUM_DRAFTS - k))

    if r == 0:
        total = tl.sum(lengths, axis=0)
        tl.store(query_start_loc_ptr, 0)
        for base in range(0, query_start_loc_len, BLOCK_TAIL):
            tail = base + tl.arange(0, BLOCK_TAIL)
            pad = (tail > num_reqs) & (tail < query_start_loc_len)
            tl.store(query_start_loc_ptr + tail, tl.zeros_like(tail) + total, mask=pad)


def compact_on_device(
    capacity: torch.Tensor,
    num_drafts: int,
    num_tokens: int,
    idx_mapping: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_num_reqs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewrite the runner's buffers (``input_ids``, ``positions``, the whole
    ``query_start_loc``, ``seq_lens[:R]``) to the compact layout of ``num_tokens`` =
    R + sum(capacity) tokens, in place, for R <= ``max_num_reqs``. Returns per compact
    token (expanded idx mapping, local position int32, logits indices int64)."""
    num_reqs = capacity.shape[0]
    uniform = num_reqs * (1 + num_drafts)
    # Snapshots: a program's source may be another program's destination.
    uniform_ids = input_ids[:uniform].clone()
    uniform_pos = positions[:uniform].clone()
    expanded_idx = torch.empty(num_tokens, dtype=idx_mapping.dtype, device=capacity.device)
    local_pos = torch.empty(num_tokens, dtype=torch.int32, device=capacity.device)
    logits_idx = torch.empty(num_tokens, dtype=torch.int64, device=capacity.device)
    _compact_kernel[(num_reqs,)](
        capacity,
        uniform_ids,
        uniform_pos,
        idx_mapping,
        input_ids,
        positions,
        query_start_loc,
        seq_lens,
        expanded_idx,
        local_pos,
        logits_idx,
        num_reqs,
        query_start_loc.shape[0],
        NUM_DRAFTS=num_drafts,
        BLOCK_R=triton.next_power_of_2(max_num_reqs),
        BLOCK_Q=triton.next_power_of_2(1 + num_drafts),
        BLOCK_TAIL=1024,
    )
    return expanded_idx, local_pos, logits_idx
