"""The DSpark training loss of the tiny pair's drafter (CE + TV + confidence BCE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DSparkLossWeights:
    """L = ce * CE + tv * TV + confidence * BCE (the DSpark paper's 0.1 / 0.9 / 1.0)."""

    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..block_size."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


def total_variation(draft_log_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """½‖p_draft − p_target‖₁ over the last dimension."""
    return 0.5 * (draft_log_probs.exp() - target_probs).abs().sum(dim=-1)


CONFIDENCE_LABELS = ("soft_tv", "greedy_match")


def dspark_loss(
    logits: torch.Tensor,
    confidence_logits: torch.Tensor,
    target_probs: torch.Tensor,
    weights: DSparkLossWeights,
    gamma: float,
    confidence_label: str = "soft_tv",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DSpark training loss over [..., block, vocab] draft logits, and detached statistics.

    The CE label is the target's greedy token (argmax of ``target_probs``). The confidence
    head learns ``soft_tv``: 1 - TV (detached), the paper's label, which is the acceptance
    probability of *sampled* verification; or ``greedy_match``: whether the draft's argmax
    is the target's, the acceptance event of *greedy* verification.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)
    labels = target_probs.argmax(dim=-1)
    ce = -log_probs.gather(-1, labels[..., None]).squeeze(-1)
    tv = total_variation(log_probs, target_probs)
    greedy_match = (log_probs.argmax(dim=-1) == labels).float()
    if confidence_label == "soft_tv":
        confidence_label = (1.0 - tv).detach().clamp(0.0, 1.0)
    elif confidence_label == "greedy_match":
        confidence_label = greedy_match
    else:
        raise ValueError(f"confidence_label must be one of {CONFIDENCE_LABELS}")
    bce = F.binary_cross_entropy_with_logits(
        confidence_logits.float(), confidence_label, reduction="none"
    )
    per_position = weights.ce * ce + weights.tv * tv + weights.confidence * bce
    w = position_weights(logits.shape[-2], gamma, logits.device)
    loss = (per_position * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "ce": ce.mean(),
            "tv": tv.mean(),
            "bce": bce.mean(),
            "top1": greedy_match.mean(),
        }
    return loss, stats
