"""How well the confidence head predicts acceptance, measured while serving.

Once the target has verified a request's drafts, the rejection sampler's result is binned
against the prefix survivals s(r, k) predicted when those drafts were proposed, per
position, on the GPU: no host synchronisation, integer counts only, so every
tensor-parallel rank reduces exactly the same. Two censoring-free statistics: conditional
(position k given drafts 1..k-1 accepted and k verified: c(r, k) against "k accepted") and
prefix (all K drafts verified: s(r, k) against "1..k all accepted", what capacity control
ranks by). :meth:`CalibrationStats.summary` gives per-position ECE (15 bins, as the
trainer's STS), AUROC (150 finer bins) and, beside each ECE, its noise floor: the ECE of an
exactly calibrated head on the same trials.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dspark.capacity.allocation import conditional_confidence

# Predictions are summed in fixed point, so that sums are exact and order-independent.
FIXED_POINT = 1 << 20
ECE_BINS = 15
FINE_BINS = 10 * ECE_BINS  # the histogram's bins: AUROC reads them, ECE merges them by 10
NOISE_DRAWS = 200


@dataclass
class PositionCalibration:
    trials: list[int]
    ece: list[float]
    auroc: list[float]
    mean_predicted: list[float]
    mean_observed: list[float]
    ece_noise_floor: list[float]


class _Histogram:
    def __init__(self, num_drafts: int, num_bins: int, device: torch.device):
        self.num_bins = num_bins
        self.trials = torch.zeros(num_drafts * num_bins, dtype=torch.int64, device=device)
        self.hits = torch.zeros_like(self.trials)
        self.predicted = torch.zeros_like(self.trials)

    def add(self, predicted: torch.Tensor, hit: torch.Tensor, counted: torch.Tensor) -> None:
        """predicted, hit, counted: [R, K]; only ``counted`` entries are added."""
        num_drafts = predicted.shape[-1]
        bins = (predicted * self.num_bins).long().clamp_(0, self.num_bins - 1)
        cells = (torch.arange(num_drafts, device=bins.device) * self.num_bins + bins).flatten()
        counted = counted.long().flatten()
        self.trials.index_add_(0, cells, counted)
        self.hits.index_add_(0, cells, counted * hit.long().flatten())
        fixed = (predicted.double() * FIXED_POINT).round().long().flatten()
        self.predicted.index_add_(0, cells, counted * fixed)

    def summary(self, num_drafts: int) -> PositionCalibration:
        trials = self.trials.view(num_drafts, self.num_bins).cpu().double()
        hits = self.hits.view(num_drafts, self.num_bins).cpu().double()
        predicted = self.predicted.view(num_drafts, self.num_bins).cpu().double() / FIXED_POINT
        result = PositionCalibration([], [], [], [], [], [])
        for k in range(num_drafts):
            n = trials[k].sum().item()
            result.trials.append(int(n))
            if n == 0:
                for values in (
                    result.ece,
                    result.auroc,
                    result.mean_predicted,
                    result.mean_observed,
                    result.ece_noise_floor,
                ):
                    values.append(float("nan"))
                continue
            # ECE: trial-weighted gap between mean prediction and hit rate per ECE bin.
            merged = (predicted[k] - hits[k]).view(ECE_BINS, -1).sum(dim=1)
            gap = merged.abs().sum().item()
            result.ece.append(gap / n)
            result.auroc.append(_binned_auroc(hits[k], trials[k] - hits[k]))
            result.mean_predicted.append(predicted[k].sum().item() / n)
            result.mean_observed.append(hits[k].sum().item() / n)
            result.ece_noise_floor.append(_ece_noise_floor(trials[k], predicted[k]))
        return result


def _ece_noise_floor(trials: torch.Tensor, predicted: torch.Tensor) -> float:
    """Mean ECE of exactly calibrated outcomes on these fine bins (trials, predicted sums)."""
    rate = (predicted / trials.clamp(min=1)).clamp(0.0, 1.0)
    generator = torch.Generator().manual_seed(0)
    draws = torch.binomial(
        trials.expand(NOISE_DRAWS, -1).contiguous(),
        rate.expand(NOISE_DRAWS, -1).contiguous(),
        generator=generator,
    )
    gaps = (predicted - draws).view(NOISE_DRAWS, ECE_BINS, -1).sum(dim=2).abs().sum(dim=1)
    return (gaps.mean() / trials.sum()).item()


def _binned_auroc(positives: torch.Tensor, negatives: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties within a bin counted half."""
    total_pos, total_neg = positives.sum().item(), negatives.sum().item()
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    below = torch.cumsum(negatives, 0) - negatives  # negatives in lower bins
    wins = (positives * below).sum() + 0.5 * (positives * negatives).sum()
    return (wins / (total_pos * total_neg)).item()


class CalibrationStats:
    def __init__(self, num_drafts: int, device: torch.device):
        self.num_drafts = num_drafts
        self.conditional = _Histogram(num_drafts, FINE_BINS, device)
        self.prefix = _Histogram(num_drafts, FINE_BINS, device)

    def observe(
        self, survival: torch.Tensor, num_verified: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """survival [R, K] as predicted at proposal; drafts verified and accepted [R]."""
        position = torch.arange(self.num_drafts, device=survival.device)  # k - 1
        verified = position < num_verified[:, None]
        accepted = position < num_accepted[:, None]
        prefix_accepted = position <= num_accepted[:, None]  # drafts 1..k-1 accepted
        self.conditional.add(conditional_confidence(survival), accepted, verified & prefix_accepted)
        fully_verified = (num_verified == self.num_drafts)[:, None].expand_as(verified)
        self.prefix.add(survival, accepted, fully_verified)

    def summary(self) -> dict[str, PositionCalibration]:
        return {
            "conditional": self.conditional.summary(self.num_drafts),
            "prefix": self.prefix.summary(self.num_drafts),
        }
