"""How many drafts each request verifies: the capacity modes, as tensor functions.

Inputs are per (request r, draft position k) confidences c(r, k) that draft k survives
given drafts 1..k-1 did; the prefix survival s(r, k) = c(r, 1) * ... * c(r, k) is
non-increasing in k. Each mode returns k_r, the leading drafts request r verifies next step.

Every mode verifies the B highest-survival (request, position) slots of the batch
(:func:`budget_capacity`, ties broken by (request, position)), so each request keeps a
contiguous prefix. The modes differ in where B comes from: ``budget`` from the batch size,
``threshold`` from the slots above the threshold in the *previous* proposal, ``sps`` from
the count that maximised expected tokens per second in the previous proposal. This stays
lossless because s(r, k) reads no draft at or after k and B reads none of the drafts it
admits; the host also needs R + B before the step, which the previous proposal's count
gives without a sync (:mod:`stale_record`). The argument in full is in
``docs/design/module-notes.md``; ``tests/cpu/test_capacity_reference.py`` checks it.

Plain tensor code without host synchronisation; the SPS table lives on the device.
"""

from __future__ import annotations

import math

import torch

# The survival of a draft position the drafter did not compute (dynamic depth): below every
# real survival, so global admission ranks it last and a budget of at most R * depth never
# reaches it; threshold counts never include it and sps never gains from it.
UNCOMPUTED_SURVIVAL = -1.0


def prefix_survival(confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """s(r, k) = prod_{j<=k} sigmoid(z(r, j) / T_j), in fp32. [R, K] -> [R, K]."""
    return torch.cumprod(torch.sigmoid(confidence_logits.float() / temperatures), dim=-1)


def conditional_confidence(survival: torch.Tensor) -> torch.Tensor:
    """c(r, k) = s(r, k) / s(r, k-1) back from prefix survivals. [..., K] -> [..., K]."""
    before = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
    return survival / before.clamp(min=1e-30)


def verification_counts(
    cu_num_logits: torch.Tensor, num_sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request of a verified step: (drafts verified, drafts accepted). A request's
    logits are its drafts plus the bonus position; it sampled its accepted drafts + 1."""
    num_verified = cu_num_logits[1:] - cu_num_logits[:-1] - 1
    return num_verified, (num_sampled - 1).clamp(min=0)


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


def budget_capacity(survival: torch.Tensor, budget: int | torch.Tensor) -> torch.Tensor:
    """Global greedy admission of the ``budget`` highest-survival slots of each batch
    (``budget``: one for all, or one per batch). [..., R, K] -> [..., R]."""
    _, ranks = _ranked(survival)
    return _admit_best(ranks, budget, survival.shape)


def threshold_count(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """Slots whose survival is at least ``threshold``: the budget ``threshold`` asks for.
    [..., R, K] -> [...] int64."""
    return (survival >= threshold).sum(dim=(-2, -1))


def sps_rates(
    survival: torch.Tensor,
    sps_table: torch.Tensor,
    fixed_seconds: float | torch.Tensor = 0.0,
    per_draft_seconds: float = 0.0,
    compaction_seconds: float = 0.0,
) -> torch.Tensor:
    """Expected tokens per second of admitting the n best slots, n = 0..R*K: (R + sum of
    the n best survivals) / (1 / SPS(R + n) + ``fixed_seconds`` + n ``per_draft_seconds``
    + ``compaction_seconds`` where n < R*K), with the step's time outside the curve's
    forward (:mod:`step_overhead`; all R*K drafts run vLLM's own step, uncompacted);
    ``fixed_seconds`` may be one per batch ([..., 1]). ``sps_table[T]`` covers T up to
    R * (1 + K). [..., R, K] -> [..., R*K + 1]."""
    num_reqs, num_drafts = survival.shape[-2:]
    ordered = survival.flatten(-2).sort(dim=-1, descending=True).values
    zero = ordered.new_zeros(ordered.shape[:-1] + (1,))
    expected = num_reqs + torch.cat([zero, torch.cumsum(ordered, dim=-1)], dim=-1)
    counts = torch.arange(expected.shape[-1], device=survival.device)
    step_seconds = sps_table[num_reqs + counts].reciprocal() + fixed_seconds
    step_seconds = step_seconds + per_draft_seconds * counts
    step_seconds = step_seconds + compaction_seconds * (counts < num_reqs * num_drafts)
    return expected / step_seconds


def best_rates_by_depth(
    survival: torch.Tensor,
    depths: torch.Tensor,
    sps_table: torch.Tensor,
    fixed_seconds: float | torch.Tensor = 0.0,
    per_draft_seconds: float = 0.0,
    compaction_seconds: float = 0.0,
) -> torch.Tensor:
    """For each depth d of ``depths`` [D]: the most expected tokens per second of sps's
    admission (:func:`sps_rates`) had the proposal computed only its first d positions
    (the rest ranked last, as :data:`UNCOMPUTED_SURVIVAL`: a depth short of K verifies
    compacted); ``fixed_seconds`` for all, or one per depth ([D]). [..., R, K] -> [..., D]."""
    computed = torch.arange(survival.shape[-1]) < depths[:, None]  # [D, K]
    drafted = torch.where(computed[:, None, :], survival.unsqueeze(-3), UNCOMPUTED_SURVIVAL)
    if isinstance(fixed_seconds, torch.Tensor):
        fixed_seconds = fixed_seconds[:, None]
    rates = sps_rates(drafted, sps_table, fixed_seconds, per_draft_seconds, compaction_seconds)
    return rates.amax(dim=-1)


def sps_best_count(
    survival: torch.Tensor,
    sps_table: torch.Tensor,
    fixed_seconds: float = 0.0,
    per_draft_seconds: float = 0.0,
    compaction_seconds: float = 0.0,
) -> torch.Tensor:
    """The admission count n in 0..R*K of most expected tokens per second
    (:func:`sps_rates`): the budget ``sps`` asks for. [..., R, K] -> [...] int64."""
    rates = sps_rates(survival, sps_table, fixed_seconds, per_draft_seconds, compaction_seconds)
    return rates.argmax(dim=-1)


def masked_forward_table(sps_table: torch.Tensor, num_reqs: int, num_drafts: int) -> torch.Tensor:
    """``sps_table`` as :func:`sps_best_count` should read it for a step of ``num_reqs``
    requests verified masked (``dspark_varlen_verify=false``): the target runs all
    R (1 + K) tokens whatever the step admits, so every admission, none included, costs
    that forward. (Read with the compacted step's table, a masked step would verify fewer
    drafts than pay: those left out save no forward time.) ``num_drafts`` 0 (steps
    compacted to what they verify): ``sps_table`` itself."""
    if num_drafts == 0:
        return sps_table
    full = num_reqs * (1 + num_drafts)
    table = sps_table.clone()
    table[num_reqs : full + 1] = sps_table[full]
    return table


def padded_to_graph_sizes(sps_table: torch.Tensor, graph_sizes: list[int]) -> torch.Tensor:
    """``sps_table`` as the runner pays it: a step of T tokens, up to the largest CUDA-graph
    size, replays the smallest captured size that holds T, padded, so it runs as long as a
    step of that size. A curve interpolated between its points makes T short of a size look
    cheaper than the size, so ``sps`` would leave drafts the padding verifies for free."""
    sizes = torch.tensor(sorted({s for s in graph_sizes if 0 < s < len(sps_table)}))
    if len(sizes) == 0:
        return sps_table
    tokens = torch.arange(int(sizes[-1]) + 1)
    table = sps_table.clone()
    table[: len(tokens)] = sps_table[sizes[torch.searchsorted(sizes, tokens)]]
    return table


def sps_table_from_curve(curve: list[tuple[int, float]], max_tokens: int) -> torch.Tensor:
    """Steps per second for T = 0..max_tokens: linear between the curve's points, held
    below the first, and beyond the last at the last point's tokens per second (SPS
    falling as 1/T). A profiled curve reaches the largest decode step the runner takes
    (past its largest graph, timed without one: :mod:`sps_profile`); a given curve may
    stop short, and steps past its end are compute-bound: holding SPS there would make
    every draft past the end look free, so ``sps`` would verify all of them under load."""
    points = torch.tensor(curve, dtype=torch.float64)
    tokens = torch.arange(max_tokens + 1, dtype=torch.float64)
    index = torch.searchsorted(points[:, 0].contiguous(), tokens).clamp(1, len(curve) - 1)
    t0, t1 = points[index - 1, 0], points[index, 0]
    v0, v1 = points[index - 1, 1], points[index, 1]
    # A one-point curve (e.g. profiled with a single decode graph) has t1 == t0.
    weight = ((tokens - t0) / (t1 - t0).clamp(min=1.0)).clamp(0.0, 1.0)
    table = v0 + weight * (v1 - v0)
    last_tokens, last_sps = points[-1, 0], points[-1, 1]
    beyond = tokens > last_tokens
    table[beyond] = last_sps * last_tokens / tokens[beyond]
    return table.float()
