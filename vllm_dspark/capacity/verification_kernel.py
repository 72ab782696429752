"""One Triton kernel for what each verified step tells the capacity controller.

After every real step, capacity control reads what it verified: per request, the drafts
verified and accepted (counting only positions the proposal computed,
:meth:`~vllm_dspark.capacity.controller.CapacityController.drafted_verification`), and for the
acceptance controller, per position, how many verifications reached it and accepted it
(:func:`~vllm_dspark.capacity.acceptance.position_counts`). In PyTorch that is ~15 small
launches per step on the GPU's stream, between the target's forward and the proposal,
enough to slow small steps measurably. This kernel computes both in one program (R is at
most max_num_seqs). :func:`drafted_counts` is the PyTorch definition (from
:mod:`allocation` and :mod:`acceptance`), which the CPU path and the tests use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_dspark.capacity.acceptance import position_counts
from vllm_dspark.capacity.allocation import verification_counts


@triton.jit(do_not_specialize=["num_reqs", "depth"])
def _verification_kernel(
    cu_num_logits_ptr,  # [R + 1]
    num_sampled_ptr,  # [R]
    per_request_ptr,  # [2, R] int32: drafts verified, drafts accepted
    counts_ptr,  # [2 K] fp32: verifications that reached position j, that accepted it
    num_reqs,
    depth,  # positions the proposal computed (0: it drafted nothing)
    NUM_DRAFTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_R)
    valid = rows < num_reqs
    start = tl.load(cu_num_logits_ptr + rows, mask=valid, other=0)
    end = tl.load(cu_num_logits_ptr + rows + 1, mask=valid, other=1)
    # A request's logits are its drafts and the bonus position; it sampled accepted + 1.
    verified = tl.minimum(end - start - 1, depth)
    sampled = tl.load(num_sampled_ptr + rows, mask=valid, other=1)
    accepted = tl.minimum(tl.maximum(sampled - 1, 0), verified)
    tl.store(per_request_ptr + rows, verified.to(tl.int32), mask=valid)
    tl.store(per_request_ptr + num_reqs + rows, accepted.to(tl.int32), mask=valid)

    positions = tl.arange(0, BLOCK_K) + 1
    verified, accepted = verified[:, None], accepted[:, None]
    counted = valid[:, None] & (positions[None, :] <= NUM_DRAFTS)
    reached = counted & (verified >= positions[None, :]) & (accepted >= positions[None, :] - 1)
    kept = counted & (accepted >= positions[None, :])
    in_range = positions <= NUM_DRAFTS
    tl.store(counts_ptr + positions - 1, tl.sum(reached.to(tl.float32), axis=0), mask=in_range)
    tl.store(
        counts_ptr + NUM_DRAFTS + positions - 1,
        tl.sum(kept.to(tl.float32), axis=0),
        mask=in_range,
    )


class Verification(NamedTuple):
    """A verified step's counts, on the device."""

    num_verified: torch.Tensor  # [R] int32, drafts the proposal computed
    num_accepted: torch.Tensor  # [R] int32
    position_counts: torch.Tensor  # [2 K] fp32: (reached, accepted) per position


def drafted_counts(
    cu_num_logits: torch.Tensor, num_sampled: torch.Tensor, depth: int, num_drafts: int
) -> Verification:
    """What :func:`verification_stats` computes, in PyTorch."""
    num_verified, num_accepted = verification_counts(cu_num_logits, num_sampled)
    num_verified = num_verified.clamp(max=depth)
    num_accepted = torch.minimum(num_accepted, num_verified)
    reached, accepted = position_counts(num_verified, num_accepted, num_drafts)
    return Verification(num_verified, num_accepted, torch.cat([reached, accepted]).float())


def verification_stats(
    cu_num_logits: torch.Tensor,
    num_sampled: torch.Tensor,
    depth: int,
    num_drafts: int,
    max_num_reqs: int,
) -> Verification:
    """Per request and per position, what one verified step of R <= ``max_num_reqs``
    requests verified and accepted of the ``depth`` positions its proposal computed."""
    num_reqs = num_sampled.shape[0]
    device = num_sampled.device
    per_request = torch.empty(2, num_reqs, dtype=torch.int32, device=device)
    counts = torch.empty(2 * num_drafts, dtype=torch.float32, device=device)
    _verification_kernel[(1,)](
        cu_num_logits,
        num_sampled,
        per_request,
        counts,
        num_reqs,
        depth,
        NUM_DRAFTS=num_drafts,
        BLOCK_R=triton.next_power_of_2(max(max_num_reqs, 1)),
        BLOCK_K=triton.next_power_of_2(num_drafts),
    )
    return Verification(per_request[0], per_request[1], counts)
