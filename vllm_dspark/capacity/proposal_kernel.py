"""One Triton kernel for what each proposal records for the steps after it.

After every real proposal, capacity control records from the drafts' prefix survivals
s(r, k): the number of drafts ``threshold`` wants verified (survivals at least the
threshold), the number ``sps`` wants (:func:`allocation.sps_best_count`: the count n
maximising (R + sum of the n best survivals) / (1/SPS(R + n) + O + b n + C [n < R K])),
and per position the summed survival the draft gate reads. In PyTorch that is ~15 small
launches per proposal, host time that matters on host-bound steps; this kernel computes all
three in one program (R * K is at most max_num_seqs * K, a few thousand values: one sort in
registers). :mod:`allocation` keeps the PyTorch definitions, which the CPU path and the
tests use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Layout of the kernel's output: [sps count, threshold count, per-position sums...].
# constexpr: a compiled kernel may read no other module globals (the interpreter would).
SPS_COUNT, THRESHOLD_COUNT, POSITION_SUMS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit(do_not_specialize=["num_reqs"])
def _proposal_stats_kernel(
    survival_ptr,  # [R, K] fp32, rows ``stride`` apart
    stride,
    sps_ptr,  # [>= R (1 + K) + 1] fp32 steps per second at T tokens
    out_ptr,  # [2 + K] fp32
    num_reqs,
    fixed_seconds,
    per_draft_seconds,
    compaction_seconds,
    threshold,
    NUM_DRAFTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WITH_SPS: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    valid = (rows[:, None] < num_reqs) & (cols[None, :] < NUM_DRAFTS)
    survival = tl.load(
        survival_ptr + rows[:, None] * stride + cols[None, :], mask=valid, other=float("-inf")
    )
    # The gate's record: per position, survival summed over requests (negatives as 0).
    sums = tl.sum(tl.where(valid, tl.maximum(survival, 0.0), 0.0), axis=0)
    tl.store(out_ptr + POSITION_SUMS + cols, sums, mask=cols < NUM_DRAFTS)
    wanted = tl.sum((valid & (survival >= threshold)).to(tl.int32), axis=None)
    tl.store(out_ptr + THRESHOLD_COUNT, wanted.to(tl.float32))

    if not WITH_SPS:
        return
    # sps: the best n >= 1 among the sorted survivals' prefixes, then n = 0 against it.
    ordered = tl.sort(tl.reshape(survival, [BLOCK_R * BLOCK_K]), descending=True)
    expected = tl.cumsum(ordered, axis=0) + num_reqs
    count = tl.arange(0, BLOCK_R * BLOCK_K) + 1
    counted = count <= num_reqs * NUM_DRAFTS
    sps = tl.load(sps_ptr + num_reqs + count, mask=counted, other=1.0)
    step = 1.0 / sps + fixed_seconds + per_draft_seconds * count.to(tl.float32)
    # Fewer than all R K drafts: a compacted step.
    step += tl.where(count < num_reqs * NUM_DRAFTS, compaction_seconds, 0.0)
    gain = tl.where(counted, expected / step, float("-inf"))
    best, best_index = tl.max(gain, axis=0, return_indices=True)
    none = num_reqs / (1.0 / tl.load(sps_ptr + num_reqs) + fixed_seconds + compaction_seconds)
    tl.store(out_ptr + SPS_COUNT, tl.where(none >= best, 0, best_index + 1).to(tl.float32))


class ProposalStats(NamedTuple):
    """Views of the kernel's output, all on the device (fp32)."""

    sps_count: torch.Tensor  # 0-d; unwritten without an SPS table
    threshold_count: torch.Tensor  # 0-d
    position_sums: torch.Tensor  # [K]


def proposal_stats(
    survival: torch.Tensor,
    sps_table: torch.Tensor | None,
    fixed_seconds: float,
    per_draft_seconds: float,
    compaction_seconds: float,
    threshold: float,
    max_num_reqs: int,
) -> ProposalStats:
    """The sps count, threshold count and per-position survival sums of one proposal's
    survivals [R, K], R <= ``max_num_reqs``."""
    num_reqs, num_drafts = survival.shape
    out = torch.empty(POSITION_SUMS.value + num_drafts, dtype=torch.float32, device=survival.device)
    _proposal_stats_kernel[(1,)](
        survival,
        survival.stride(0),
        sps_table if sps_table is not None else out,
        out,
        num_reqs,
        fixed_seconds,
        per_draft_seconds,
        compaction_seconds,
        threshold,
        NUM_DRAFTS=num_drafts,
        BLOCK_R=triton.next_power_of_2(max_num_reqs),
        BLOCK_K=triton.next_power_of_2(num_drafts),
        WITH_SPS=sps_table is not None,
    )
    return ProposalStats(
        out[SPS_COUNT.value], out[THRESHOLD_COUNT.value], out[POSITION_SUMS.value :]
    )
