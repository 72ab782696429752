"""Online Sequential Temperature Scaling: keep the confidence head calibrated while serving.

What is calibrated is what capacity control reads, the prefix survival
s_k = prod_{j<=k} sigmoid(z_j / T_j), against "drafts 1..k all accepted". Per position k the
rejection sampler's results are binned by the raw logit z_k and by the prefix survival
s_{k-1} under the temperatures in use, in counts that decay per step. Every ``refit_every``
steps T_1..T_K are refitted in order as offline STS does (a grid search minimising the
survival's ECE over ``ECE_BINS`` bins), each blended toward the checkpoint's temperature by
its trial count. Counts are integers and the fit runs in a fixed order, so ranks fed the
same results get bit-identical temperatures; the refit costs one small blocking copy.
"""

from __future__ import annotations

import torch

Z_BINS = 64
Z_RANGE = 8.0  # z bins cover [-8, 8]; beyond, the end bins
PREFIX_BINS = 32
PREFIX_RANGE = 8.0  # prefix bins cover -log s_{k-1} in [0, 8]; beyond, the last bin
SURVIVAL_BITS = 24
ECE_BINS = 15
DECAY = 0.999  # per step: a half-life of ~700 steps
REFIT_EVERY = 256
PRIOR_WEIGHT = 2000.0  # trials at which the fit and the prior weigh the same
GRID = torch.exp(torch.linspace(-1.6, 1.6, 161, dtype=torch.float64))  # T in [0.2, 5]


def z_bin_centers() -> torch.Tensor:
    width = 2 * Z_RANGE / Z_BINS
    return (torch.arange(Z_BINS, dtype=torch.float64) + 0.5) * width - Z_RANGE


class OnlineSTS:
    def __init__(
        self,
        prior: torch.Tensor,
        refit_every: int = REFIT_EVERY,
        decay: float = DECAY,
        prior_weight: float = PRIOR_WEIGHT,
    ):
        num_drafts, device = prior.numel(), prior.device
        self.prior = prior.double().cpu()
        self.refit_every, self.decay, self.prior_weight = refit_every, decay, prior_weight
        shape = (num_drafts, Z_BINS * PREFIX_BINS)
        self.trials = torch.zeros(shape, dtype=torch.float64, device=device)
        self.hits = torch.zeros_like(self.trials)
        self.prefix_sums = torch.zeros_like(self.trials)  # sum of s_{k-1} per cell
        self.steps = 0
        self.refits = 0
        self.fitted_at_step = 0  # the step of the last refit (0: the prior)
        self.calibration_error = [float("nan")] * num_drafts

    def observe(
        self,
        logits: torch.Tensor,
        num_verified: torch.Tensor,
        num_accepted: torch.Tensor,
        temperatures: torch.Tensor,
    ) -> None:
        """One step: raw logits [R, K] at proposal, drafts verified and accepted [R], the
        temperatures in use [K]."""
        num_drafts = logits.shape[1]
        position = torch.arange(num_drafts, device=logits.device)
        z = logits.float()
        log_confidence = torch.nn.functional.logsigmoid(z / temperatures.float())
        log_prefix = torch.cumsum(log_confidence, dim=1) - log_confidence  # log s_{k-1}
        known = (position < num_verified[:, None]) | (num_accepted < num_verified)[:, None]
        survived = position < num_accepted[:, None]
        z_bins = ((z + Z_RANGE) * (Z_BINS / (2 * Z_RANGE))).long().clamp_(0, Z_BINS - 1)
        prefix_bins = (-log_prefix * (PREFIX_BINS / PREFIX_RANGE)).long().clamp_(0, PREFIX_BINS - 1)
        cells = ((position * Z_BINS + z_bins) * PREFIX_BINS + prefix_bins).flatten()
        units = torch.round(log_prefix.exp() * 2.0**SURVIVAL_BITS).long()
        size = num_drafts * Z_BINS * PREFIX_BINS
        step = torch.zeros(3, size, dtype=torch.int64, device=logits.device)
        step[0].index_add_(0, cells, known.long().flatten())
        step[1].index_add_(0, cells, (known & survived).long().flatten())
        step[2].index_add_(0, cells, torch.where(known, units, 0).flatten())
        step = step.view(3, *self.trials.shape).double()
        self.trials.mul_(self.decay).add_(step[0])
        self.hits.mul_(self.decay).add_(step[1])
        self.prefix_sums.mul_(self.decay).add_(step[2] * 2.0**-SURVIVAL_BITS)
        self.steps += 1

    def maybe_refit(self, temperatures: torch.Tensor) -> bool:
        """Every ``refit_every`` steps, write refitted temperatures into ``temperatures``
        (in place: captured graphs read that tensor). Returns whether it refitted."""
        if self.steps == 0 or self.steps % self.refit_every:
            return False
        trials, hits, prefix_sums = self.trials.cpu(), self.hits.cpu(), self.prefix_sums.cpu()
        confidence = torch.sigmoid(z_bin_centers()[None, :] / GRID[:, None])  # [grid, z]
        fitted = self.prior.clone()
        for k in range(trials.shape[0]):
            n = trials[k].sum().item()
            if n == 0:
                continue
            # [grid, z, prefix] predicted survivals summed over each cell's trials.
            predicted = confidence[:, :, None] * prefix_sums[k].view(1, Z_BINS, PREFIX_BINS)
            predicted = predicted.flatten(1)
            mean = predicted / trials[k].clamp(min=1e-12)
            bins = (mean * ECE_BINS).long().clamp_(0, ECE_BINS - 1)
            gaps = torch.zeros(len(GRID), ECE_BINS, dtype=torch.float64)
            gaps.scatter_add_(1, bins, predicted - hits[k])
            errors = gaps.abs().sum(dim=1) / n
            best = int(torch.argmin(errors))
            self.calibration_error[k] = float(errors[best])
            weight = n / (n + self.prior_weight)
            fitted[k] = (1 - weight) * self.prior[k] + weight * GRID[best]
        temperatures.copy_(fitted.to(temperatures.dtype))
        self.refits += 1
        self.fitted_at_step = self.steps
        return True
