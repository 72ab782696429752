"""Greedy draft tokens from approximate (FP8) logits, rescored with the exact weights.

Kept free of vLLM imports: the GPU tests use it on the embedded pair without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Candidates of the FP8 logits that greedy drafting rescores with the bf16 weights.
RESCORE_CANDIDATES = 4


def rescored_argmax(
    approx_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    markov_embed: torch.Tensor | None = None,
    markov_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    first_id: int = 0,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Argmax of ``scale * (hidden @ weight.T + markov_embed @ markov_weight.T)``, searched
    among the top ``RESCORE_CANDIDATES`` of ``approx_logits`` (same vocabulary, already
    scaled). [rows] int64.

    Under tensor parallelism ``weight`` and ``markov_weight`` are this rank's vocabulary
    shard, token ids ``first_id`` on: each rank scores the candidates it holds, zero for
    the others, and ``all_reduce`` sums the ranks' scores (each candidate's from the one
    rank that holds it, so the sum is that score exactly)."""
    # In vocabulary order, so that ties go to the lowest index as in the bf16 argmax.
    candidates = approx_logits.topk(RESCORE_CANDIDATES, dim=-1).indices.sort(dim=-1).values
    rows = candidates - first_id
    held = (rows >= 0) & (rows < weight.shape[0])
    rows = rows.clamp(0, weight.shape[0] - 1)
    exact = torch.einsum("rh,rch->rc", hidden, weight[rows])
    if markov_weight is not None:
        exact = exact + torch.einsum("rh,rch->rc", markov_embed, markov_weight[rows])
    if all_reduce is not None:
        exact = all_reduce(torch.where(held, exact.float(), 0.0))
    exact = exact * scale
    return candidates.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)
