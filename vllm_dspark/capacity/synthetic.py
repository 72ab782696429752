"""Calibrated synthetic confidence, for benchmarks with dummy weights.

Dummy weights accept nothing, and vLLM's synthetic acceptance (one fixed rate per
position) gives a confidence head nothing to predict. With ``dspark_synthetic_confidence``
each draft k of request r gets a confidence c(r, k) = sigmoid(logit(m_k) + e), e ~ N(0, 1),
around the per-position median m_k, drawn inside the captured draft graph in place of the
confidence head; verification then accepts it with probability c(r, k) given its prefix
was accepted (:mod:`vllm_dspark.patches.calibrated_synthetic`). Confidence is calibrated
by construction, so capacity control sees what a perfect head would tell it.
"""

from __future__ import annotations

import torch

# Spread of the confidence logits around each position's median.
LOGIT_SPREAD = 1.0


class SyntheticConfidence:
    def __init__(self, medians: list[float], device: torch.device):
        medians_t = torch.tensor(medians, dtype=torch.float32, device=device)
        self.center = torch.logit(medians_t)

    def draw(self, num_reqs: int) -> torch.Tensor:
        """Confidence logits [num_reqs, K] (graph-safe: torch's CUDA RNG)."""
        noise = torch.randn(num_reqs, self.center.numel(), device=self.center.device)
        return self.center + LOGIT_SPREAD * noise


def accepted_lengths(
    confidence: torch.Tensor, num_verified: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Leading verified drafts accepted when draft k passes iff ``uniform < confidence``.
    confidence, uniform: [R, K]; num_verified: [R]. Returns [R] int64."""
    positions = torch.arange(confidence.shape[1], device=confidence.device)
    passes = (uniform < confidence) & (positions < num_verified.unsqueeze(1))
    return passes.long().cumprod(dim=1).sum(dim=1)
