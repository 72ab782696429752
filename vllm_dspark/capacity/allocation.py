"""How many drafts each request verifies: the capacity modes, as tensor functions.

Inputs are per (request r, draft position k) confidences c(r, k): the DSpark confidence
head's estimate that draft k survives verification given that drafts 1..k-1 did. The
prefix survival s(r, k) = c(r, 1) * ... * c(r, k) is non-increasing in k. Each mode
returns k_r, the number of leading drafts request r verifies in the next target step.

Why this stays lossless
-----------------------
Speculative sampling reproduces the target distribution for any number of verified
drafts chosen *before* the drafts are looked at. It breaks when the decision to verify
draft k depends on draft k itself (DSpark paper, Appendix A): stopping whenever the
sampled token looks unlikely removes exactly those tokens from the accepted mass.
DSpark's confidence for position k reads the backbone state h_k, which depends on no
draft, and the Markov embedding of the *previous* draft x_{k-1}, so c(r, k) and s(r, k)
depend only on drafts before k. A mode is lossless when "verify draft k of request r"
depends only on s(r, 1..k) and on other requests, never on s(r, j) for j > k (those
read x_k):

- ``threshold``: k_r = #{k : s(r, k) >= t}; s is non-increasing, so draft k is
  verified iff s(r, k) >= t. Causal per position.
- ``budget``: the B = ceil(R * K * frac) highest-survival slots of the batch. Slots are
  ranked by survival with ties broken by (request, position), so request r's later
  slots never rank above its slot k; slot (r, k) is admitted iff fewer than B slots of
  *other* requests or earlier positions rank above it. Other requests' drafts are
  independent of r's, so the decision for (r, k) reads nothing of x_k. Each request
  keeps a contiguous prefix because s is non-increasing.
- ``sps``: admit slots in that same order while the expected throughput
  (R + sum of admitted survivals) * SPS(R + admitted) keeps rising, and stop at its
  first drop. Scanning every count and keeping the global maximum would be better
  for speed but not lossless: whether the maximum lies past slot (r, k) depends on
  the survivals of r's later slots, which read x_k. The first-drop stop decides
  about the n-th slot from the first n slots only, and those never include r's
  positions after k when the n-th slot is (r, k).

``tests/cpu/test_capacity_reference.py`` checks each mode against the target's own
distribution with a chi-square test, and checks that a mode that looks at the current
draft's own confidence fails the same test.

All functions are plain tensor code without host synchronisation, so they run
inside a captured CUDA graph; the budget B and the SPS table live on the device.
"""

from __future__ import annotations

import math

import torch


def prefix_survival(confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """s(r, k) = prod_{j<=k} sigmoid(z(r, j) / T_j), in fp32. [R, K] -> [R, K]."""
    return torch.cumprod(torch.sigmoid(confidence_logits.float() / temperatures), dim=-1)


def threshold_capacity(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """The longest prefix whose survival is at least ``threshold``. [..., R, K] -> [..., R]."""
    return (survival >= threshold).sum(dim=-1)


def admission_budget(num_reqs: int, num_drafts: int, budget_frac: float) -> int:
    """ceil(R * K * frac), known on the host from the batch size alone."""
    slots = num_reqs * num_drafts
    return min(slots, math.ceil(slots * budget_frac - 1e-9))


def _ranked(survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of each batch, highest survival first, ties by (request, position).

    Returns (sorted survivals [..., R*K], rank of each flat slot r*K + k [..., R*K]).
    """
    flat = survival.flatten(-2)
    # stable=True keeps the flat (request, position) order among equal survivals.
    ordered, order = torch.sort(flat, dim=-1, descending=True, stable=True)
    positions = torch.arange(flat.shape[-1], device=flat.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    return ordered, ranks


def _admit_best(ranks: torch.Tensor, count: torch.Tensor | int, shape: torch.Size) -> torch.Tensor:
    """k_r when the ``count`` best-ranked slots of each batch are admitted."""
    if isinstance(count, torch.Tensor):
        count = count.unsqueeze(-1)
    return (ranks < count).view(shape).sum(dim=-1)


def budget_capacity(survival: torch.Tensor, budget: int) -> torch.Tensor:
    """Global greedy admission of the ``budget`` highest-survival slots of each batch.
    [..., R, K] -> [..., R]."""
    _, ranks = _ranked(survival)
    return _admit_best(ranks, budget, survival.shape)


def sps_capacity(survival: torch.Tensor, sps_table: torch.Tensor, budget: int) -> torch.Tensor:
    """Admit slots in survival order while expected tokens/s rises; stop at its first drop.

    ``sps_table[T]`` is the target's steps per second at T tokens per step, for T up to
    at least R + budget. At most ``budget`` slots are admitted. [..., R, K] -> [..., R].
    """
    num_reqs = survival.shape[-2]
    ordered, ranks = _ranked(survival)
    gains = ordered[..., :budget]
    zero = gains.new_zeros(gains.shape[:-1] + (1,))
    # expected[n]: tokens per step with the n best slots admitted, n = 0..budget.
    expected = num_reqs + torch.cat([zero, torch.cumsum(gains, dim=-1)], dim=-1)
    counts = torch.arange(budget + 1, device=survival.device)
    throughput = expected * sps_table[num_reqs + counts]
    # A drop at n (admitting slot n+1 lowers throughput) keeps n slots; no drop keeps all.
    drops = throughput[..., 1:] < throughput[..., :-1]
    keep = torch.where(drops, counts[:-1], budget).amin(dim=-1)
    return _admit_best(ranks, keep, survival.shape)


def sps_table_from_curve(curve: list[tuple[int, float]], max_tokens: int) -> torch.Tensor:
    """Steps per second for T = 0..max_tokens, linear between the curve's points and
    held at its ends."""
    points = torch.tensor(curve, dtype=torch.float64)
    tokens = torch.arange(max_tokens + 1, dtype=torch.float64)
    index = torch.searchsorted(points[:, 0].contiguous(), tokens).clamp(1, len(curve) - 1)
    t0, t1 = points[index - 1, 0], points[index, 0]
    v0, v1 = points[index - 1, 1], points[index, 1]
    weight = ((tokens - t0) / (t1 - t0)).clamp(0.0, 1.0)
    return (v0 + weight * (v1 - v0)).float()
