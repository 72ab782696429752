"""Greedy draft tokens from approximate (FP8) logits, rescored with the exact weights.

Kept free of vLLM imports: the GPU tests use it on the embedded pair without vLLM.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """Argmax of ``scale * (hidden @ weight.T + markov_embed @ markov_weight.T)``, searched
    among the top ``RESCORE_CANDIDATES`` of ``approx_logits`` (same vocabulary, already
    scaled). [rows] int64."""
    # In vocabulary order, so that ties go to the lowest index as in the bf16 argmax.
    candidates = approx_logits.topk(RESCORE_CANDIDATES, dim=-1).indices.sort(dim=-1).values
    exact = torch.einsum("rh,rch->rc", hidden, weight[candidates])
    if markov_weight is not None:
        exact = exact + torch.einsum("rh,rch->rc", markov_embed, markov_weight[candidates])
    exact = exact * scale
    return candidates.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)
