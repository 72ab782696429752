"""Calibrated synthetic confidence, for benchmarks with dummy weights.

Dummy weights accept nothing, and vLLM's synthetic acceptance (one fixed rate per
position) gives a confidence head nothing to predict. With ``dspark_synthetic_confidence``
each draft k of request r gets a confidence c(r, k) = sigmoid(b_k + LOGIT_SPREAD * e),
e ~ N(0, 1), drawn inside the captured draft graph in place of the confidence head;
verification then accepts it with probability c(r, k) given its prefix was accepted
(:mod:`vllm_dspark.bench.synthetic_acceptance`). Confidence is calibrated by
construction, so capacity control sees what a perfect head would tell it.

Two choices make the draws stand for a trained head on a real acceptance profile:
- b_k is solved so that the *mean* confidence at position k is the option's k-th value,
  the conditional acceptance rate: fixed-depth drafting then accepts exactly the profile
  vLLM's synthetic rates give (the median there would pull every mean toward 1/2: the
  device README's profile, 3.9 tokens per step at k=7, came out as 3.5);
- LOGIT_SPREAD = 2 makes the prefix survival tell accepted from rejected prefixes with an
  AUROC of 0.81 to 0.88 over positions 1-7 on that profile, where DSpark reports 0.81 to
  0.90 for its raw head and the embedded pair's head measures 0.83 to 0.92. A spread of
  1 gave 0.69 to 0.75: a head far worse than any trained one.

The draws are common random numbers: e and the acceptance draw u are functions of the
request's sampling seed and the draft token's position alone (:func:`counter_uniform`),
not of a generator's state. Two arms of a sweep that serve the same seeded requests meet
the same e and u wherever they draft the same position at the same depth, so they differ
by what they decide, not by their draws (docs/design/module-notes.md says what one
generator per engine did instead).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Spread of the confidence logits around each position's centre.
LOGIT_SPREAD = 2.0
# Gauss-Hermite nodes for E[sigmoid(b + LOGIT_SPREAD * e)]: exact to float32 at 64.
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(64)
# Independent streams of draws per (seed, position).
NORMAL_RADIUS_STREAM, NORMAL_ANGLE_STREAM, ACCEPT_STREAM = 1, 2, 3

_MASK_32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 for 32-bit x held in int64, in 16-bit halves of the constant
    so that no product leaves int64 (whose overflow torch does not define)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK_32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with
    probability about 1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform draws in (0, 1), float32, a function of (seed, position, stream) alone
    (broadcast elementwise): each input folded into a hash in turn, exact on any device
    and inside a CUDA graph (elementwise int64 operations, no generator)."""
    seeds, positions = seeds.long(), positions.long()
    x = _fmix32(torch.full_like(positions, (stream * _GOLDEN) & _MASK_32) ^ (positions & _MASK_32))
    x = _fmix32(x ^ ((seeds >> 32) & _MASK_32))
    x = _fmix32(x ^ (seeds & _MASK_32))
    # 23 bits and a half: exact in float32, strictly between 0 and 1.
    return ((x >> 9).float() + 0.5) / float(1 << 23)


def mean_confidence(center: float) -> float:
    """E[sigmoid(center + LOGIT_SPREAD * e)], e ~ N(0, 1)."""
    values = 1.0 / (1.0 + np.exp(-(center + LOGIT_SPREAD * _NODES)))
    return float(values @ _WEIGHTS / _WEIGHTS.sum())


def center_for_mean(mean: float) -> float:
    """The logit centre b whose confidences average ``mean`` (bisection: the mean rises
    with b, from 0 to 1)."""
    low, high = -40.0, 40.0
    for _ in range(100):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if mean_confidence(middle) < mean else (low, middle)
    return 0.5 * (low + high)


class SyntheticConfidence:
    def __init__(self, means: list[float], device: torch.device):
        centers = [center_for_mean(m) for m in means]
        self.center = torch.tensor(centers, dtype=torch.float32, device=device)

    def draw(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Confidence logits [R, K] of the drafts at ``positions`` [R, K] of the requests
        whose sampling seeds are ``seeds`` [R] (Box-Muller normals from
        :func:`counter_uniform`)."""
        seeds = seeds.unsqueeze(1)
        radius = counter_uniform(seeds, positions, NORMAL_RADIUS_STREAM).log().mul(-2.0).sqrt()
        angle = (2.0 * math.pi) * counter_uniform(seeds, positions, NORMAL_ANGLE_STREAM)
        return self.center + LOGIT_SPREAD * radius * torch.cos(angle)


def acceptance_draws(seeds: torch.Tensor, first_positions: torch.Tensor, num_drafts: int):
    """u [R, K] of each request's drafts 1..K, which follow the token at ``first_positions``
    [R] (the position of the step's first verified logit), for requests of ``seeds`` [R]."""
    offsets = torch.arange(1, num_drafts + 1, device=first_positions.device)
    positions = first_positions.long().unsqueeze(1) + offsets
    return counter_uniform(seeds.unsqueeze(1), positions, ACCEPT_STREAM)


def accepted_lengths(
    confidence: torch.Tensor, num_verified: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Leading verified drafts accepted when draft k passes iff ``uniform < confidence``.
    confidence, uniform: [R, K]; num_verified: [R]. Returns [R] int64."""
    positions = torch.arange(confidence.shape[1], device=confidence.device)
    passes = (uniform < confidence) & (positions < num_verified.unsqueeze(1))
    return passes.long().cumprod(dim=1).sum(dim=1)
