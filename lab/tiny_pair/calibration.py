"""Calibration of the confidence head: ECE, AUROC and Sequential Temperature Scaling.

The drafter's confidence ``c_k`` estimates P(draft k accepted | drafts 1..k-1 accepted), so
the prefix survival ``s_k = prod_{j<=k} c_j`` estimates P(drafts 1..k all accepted). STS
(DSpark paper) divides each position's confidence logit by a temperature ``T_k``, fitted
for k = 1..K in turn by a 1-D grid search that minimises the ECE of ``s_k`` against the
observed survival, with ``T_1..T_{k-1}`` already fixed. Temperatures are positive, so
every ``c_k`` keeps its ranking. Before STS, :func:`fit_position_heads` refits the
linear head itself on verify steps, one row per draft position (a form the plugin reads,
see ``vllm_dspark.capacity.confidence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dspark.tiny_pair.drafter import sigmoid

DEFAULT_NUM_BINS = 15


def expected_calibration_error(
    predicted: np.ndarray, observed: np.ndarray, num_bins: int = DEFAULT_NUM_BINS
) -> float:
    """ECE with equal-width bins on [0, 1]: sum_b (n_b / n) |mean(pred_b) - mean(obs_b)|."""
    predicted = np.asarray(predicted, dtype=np.float64).ravel()
    observed = np.asarray(observed, dtype=np.float64).ravel()
    if predicted.size == 0:
        return float("nan")
    bins = np.clip((predicted * num_bins).astype(np.int64), 0, num_bins - 1)
    predicted_sum = np.bincount(bins, weights=predicted, minlength=num_bins)
    observed_sum = np.bincount(bins, weights=observed, minlength=num_bins)
    return float(np.abs(predicted_sum - observed_sum).sum() / predicted.size)


def auroc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (ties count one half); None when one class is absent."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).astype(bool).ravel()
    num_pos, num_neg = int(labels.sum()), int((~labels).sum())
    if num_pos == 0 or num_neg == 0:
        return None
    # Average 1-based ranks over ties (Mann-Whitney U).
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1
    ranks = (first_rank + (counts - 1) / 2.0)[inverse]
    u = ranks[labels].sum() - num_pos * (num_pos + 1) / 2
    return float(u / (num_pos * num_neg))


def survival(confidence_logits: np.ndarray, temperatures: np.ndarray | None = None) -> np.ndarray:
    """[n, K] confidence logits -> [n, K] prefix survival prod_{j<=k} sigmoid(z_j / T_j)."""
    z = np.asarray(confidence_logits, dtype=np.float64)
    if temperatures is not None:
        z = z / np.asarray(temperatures, dtype=np.float64)[None, :]
    return np.cumprod(sigmoid(z), axis=1)


def survival_events(accepted: np.ndarray) -> np.ndarray:
    """[n, K] per-position greedy matches -> [n, K] 'drafts 1..k all accepted'."""
    return np.cumprod(np.asarray(accepted, dtype=bool), axis=1).astype(bool)


@dataclass
class STSFit:
    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]


def temperature_grid(num: int = 161, low: float = 0.25, high: float = 4.0) -> np.ndarray:
    """Candidate temperatures. Bounded: the head is already fitted, STS fine-tunes it; wide
    ranges let a small split choose degenerate fits (T -> inf flattens every c_k to 1/2)."""
    grid = np.geomspace(low, high, num)
    return np.unique(np.r_[grid, 1.0])


def fit_sequential_temperature_scaling(
    confidence_logits: np.ndarray,
    accepted: np.ndarray,
    grid: np.ndarray | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> STSFit:
    """Fit T_1..T_K in order, each minimising ECE(s_k, survived_k) given the earlier T."""
    z = np.asarray(confidence_logits, dtype=np.float64)
    events = survival_events(accepted)
    grid = temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    num_positions = z.shape[1]
    prefix = np.ones(z.shape[0])
    temperatures: list[float] = []
    ece_before = [
        expected_calibration_error(s, events[:, k], num_bins) for k, s in enumerate(survival(z).T)
    ]
    ece_after: list[float] = []
    for k in range(num_positions):
        candidates = prefix[None, :] * sigmoid(z[None, :, k] / grid[:, None])  # [grid, n]
        errors = [expected_calibration_error(c, events[:, k], num_bins) for c in candidates]
        best = int(np.argmin(errors))
        # Among equally good temperatures prefer the one closest to 1 (no change).
        ties = np.flatnonzero(np.isclose(errors, errors[best], rtol=0, atol=1e-12))
        best = int(ties[np.argmin(np.abs(np.log(grid[ties])))])
        temperatures.append(float(grid[best]))
        ece_after.append(float(errors[best]))
        prefix = candidates[best]
    return STSFit(temperatures=temperatures, ece_before=ece_before, ece_after=ece_after)


def calibration_report(
    confidence_logits: np.ndarray,
    accepted: np.ndarray,
    temperatures: list[float] | None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> dict[str, list]:
    """Per-position AUROC and ECE of the survival prediction, raw and with ``temperatures``."""
    events = survival_events(accepted)
    raw = survival(confidence_logits)
    report: dict[str, list] = {
        "auroc": [auroc(raw[:, k], events[:, k]) for k in range(raw.shape[1])],
        "ece_raw": [
            expected_calibration_error(raw[:, k], events[:, k], num_bins)
            for k in range(raw.shape[1])
        ],
        "mean_survival_predicted_raw": raw.mean(axis=0).tolist(),
        "mean_survival_observed": events.mean(axis=0).tolist(),
    }
    if temperatures is not None:
        scaled = survival(confidence_logits, np.asarray(temperatures))
        report["auroc_sts"] = [auroc(scaled[:, k], events[:, k]) for k in range(raw.shape[1])]
        report["ece_sts"] = [
            expected_calibration_error(scaled[:, k], events[:, k], num_bins)
            for k in range(raw.shape[1])
        ]
        report["mean_survival_predicted_sts"] = scaled.mean(axis=0).tolist()
    return report


def fit_position_heads(
    inputs: np.ndarray, accepted: np.ndarray, l2: float = 1e-3, max_iter: int = 500
) -> tuple[np.ndarray, np.ndarray]:
    """One logistic regression per draft position: the confidence head's rows.

    c_k predicts P(draft k accepted | drafts 1..k-1 accepted), so position k is fitted on
    the verify steps whose prefix reached it: inputs [n, K, D] -> (inputs[:, k],
    accepted[:, k]) where drafts 1..k-1 were accepted. Each fit runs on standardised
    inputs (``l2`` is the ridge penalty there) and is folded back into raw-input weights.
    Returns weight [K, D] and bias [K].
    """
    survived = np.cumprod(accepted, axis=1).astype(bool)
    reached = np.concatenate([np.ones((len(accepted), 1), bool), survived[:, :-1]], axis=1)
    weights, biases = [], []
    for k in range(accepted.shape[1]):
        x = torch.as_tensor(inputs[reached[:, k], k], dtype=torch.float64)
        y = torch.as_tensor(accepted[reached[:, k], k], dtype=torch.float64)
        mean, scale = x.mean(0), x.std(0) + 1e-6
        standardised = (x - mean) / scale
        w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
        b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS(
            [w, b], max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-10
        )

        def closure(w=w, b=b, optimizer=optimizer, standardised=standardised, y=y):
            optimizer.zero_grad()
            logits = standardised @ w + b
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
            loss = loss + l2 * w.pow(2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            weights.append((w / scale).numpy())
            biases.append(float(b - (w * mean / scale).sum()))
    return np.stack(weights), np.asarray(biases)
