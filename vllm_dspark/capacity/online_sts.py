"""Online Sequential Temperature Scaling: keep the confidence head calibrated while serving.

Per draft position k, the rejection sampler's results are binned against the raw
confidence logit z_k the proposal had: a trial wherever draft k was verified after an
accepted prefix (what c_k = sigmoid(z_k / T_k) predicts), a hit where it was accepted.
Unverified drafts are censored, not counted as rejections. Counts decay exponentially per
step, so the fit follows the traffic. Every ``refit_every`` steps each T_k is refitted by a
grid search minimising the calibration error over the logit bins,
sum_b |n_b * sigmoid(z_b / T) - hits_b| / sum_b n_b, and blended toward the prior
temperature (the checkpoint's) by n / (n + prior_weight), n the position's decayed trials.

Each step's counts are integers (exact, order-free ``index_add_``); the decay and the fit
are elementwise and in a fixed order, so ranks fed the same results compute bit-identical
temperatures. The refit reads the counts on the host: one small blocking copy every
``refit_every`` steps.
"""

from __future__ import annotations

import torch

Z_BINS = 128
Z_RANGE = 8.0  # bins cover z in [-8, 8]; beyond, the end bins
DECAY = 0.999  # per step: a half-life of ~700 steps
REFIT_EVERY = 256
PRIOR_WEIGHT = 2000.0  # trials at which the fit and the prior weigh the same
GRID = torch.exp(torch.linspace(-1.6, 1.6, 161, dtype=torch.float64))  # T in [0.2, 5]


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
        self.trials = torch.zeros(num_drafts, Z_BINS, dtype=torch.float64, device=device)
        self.hits = torch.zeros_like(self.trials)
        self.steps = 0
        self.refits = 0
        self.calibration_error = [float("nan")] * num_drafts

    def observe(
        self, logits: torch.Tensor, num_verified: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """One step: raw logits [R, K] at proposal, drafts verified and accepted [R]."""
        num_drafts = logits.shape[1]
        position = torch.arange(num_drafts, device=logits.device)
        counted = (position < num_verified[:, None]) & (position <= num_accepted[:, None])
        accepted = position < num_accepted[:, None]
        scaled = (logits.float() + Z_RANGE) * (Z_BINS / (2 * Z_RANGE))
        bins = scaled.long().clamp_(0, Z_BINS - 1)
        cells = (position * Z_BINS + bins).flatten()
        step_trials = torch.zeros(num_drafts * Z_BINS, dtype=torch.int64, device=logits.device)
        step_hits = torch.zeros_like(step_trials)
        step_trials.index_add_(0, cells, counted.long().flatten())
        step_hits.index_add_(0, cells, (counted & accepted).long().flatten())
        self.trials.mul_(self.decay).add_(step_trials.view_as(self.trials).double())
        self.hits.mul_(self.decay).add_(step_hits.view_as(self.hits).double())
        self.steps += 1

    def maybe_refit(self, temperatures: torch.Tensor) -> bool:
        """Every ``refit_every`` steps, write refitted temperatures into ``temperatures``
        (in place: captured graphs read that tensor). Returns whether it refitted."""
        if self.steps == 0 or self.steps % self.refit_every:
            return False
        trials, hits = self.trials.cpu(), self.hits.cpu()
        centers = (torch.arange(Z_BINS, dtype=torch.float64) + 0.5) * (2 * Z_RANGE / Z_BINS)
        centers = centers - Z_RANGE
        predicted = torch.sigmoid(centers[None, :] / GRID[:, None])  # [grid, bins]
        fitted = self.prior.clone()
        for k in range(trials.shape[0]):
            n = trials[k].sum().item()
            if n == 0:
                continue
            errors = (trials[k][None, :] * predicted - hits[k][None, :]).abs().sum(dim=1) / n
            best = int(torch.argmin(errors))
            self.calibration_error[k] = float(errors[best])
            weight = n / (n + self.prior_weight)
            fitted[k] = (1 - weight) * self.prior[k] + weight * GRID[best]
        temperatures.copy_(fitted.to(temperatures.dtype))
        self.refits += 1
        return True
