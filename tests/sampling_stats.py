"""Were two sets of sampled outputs drawn from one distribution?

Sampled speculative decoding is lossless when its outputs follow the target's distribution,
which no single output can show: this compares many samples of the same prompts. Each
prompt's samples are binned by their first k tokens (the tuple), and a chi-square test of
homogeneity runs on the 2 x C table of bin counts (reference against candidate), after
pooling the bins too rare for the chi-square approximation; the prompts' statistics and
degrees of freedom add up (independent samples). The p-value is the chi-square survival
function, computed as the regularized upper incomplete gamma function (torch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

# Bins whose expected count in either row is below this join one pooled bin (the usual
# rule for the chi-square approximation).
MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class Homogeneity:
    p_value: float
    statistic: float
    dof: int


def bin_first_tokens(outputs: list[list[int]], prompt_of: list[int], k: int) -> dict[int, Counter]:
    """Per prompt, how often each tuple of the first ``k`` output tokens came out
    (``prompt_of[i]``: the prompt of output i). Outputs shorter than ``k`` are refused: a
    sample stopped early would be a bin of its own."""
    bins: dict[int, Counter] = {}
    for tokens, prompt in zip(outputs, prompt_of, strict=True):
        if len(tokens) < k:
            raise ValueError(f"an output of {len(tokens)} tokens, fewer than {k}")
        bins.setdefault(prompt, Counter())[tuple(tokens[:k])] += 1
    return bins


def pooled_table(reference: Counter, candidate: Counter, min_expected: float = MIN_EXPECTED):
    """The 2 x C table of counts (rows: reference, candidate), bins ordered by total count,
    those with an expected count below ``min_expected`` in either row pooled into one last
    bin; a pooled bin still below it joins the smallest kept bin."""
    totals = reference + candidate
    rows = np.array([sum(reference.values()), sum(candidate.values())], dtype=np.float64)
    share = rows.min() / rows.sum()  # expected count of a bin = its total x this, at least
    kept = [b for b, n in totals.most_common() if n * share >= min_expected]
    rare = [b for b in totals if b not in set(kept)]
    columns = [[reference[b], candidate[b]] for b in kept]
    if rare:
        pooled = [sum(reference[b] for b in rare), sum(candidate[b] for b in rare)]
        if sum(pooled) * share >= min_expected or not columns:
            columns.append(pooled)
        else:
            columns[-1] = [columns[-1][0] + pooled[0], columns[-1][1] + pooled[1]]
    return np.array(columns, dtype=np.float64).T


def chi_square(table: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of a contingency table and its degrees of freedom; a table of
    one column (every sample in one bin) has none."""
    rows, columns = table.shape
    if columns < 2:
        return 0.0, 0
    expected = np.outer(table.sum(1), table.sum(0)) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), (rows - 1) * (columns - 1)


def chi_square_p_value(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with ``dof`` degrees of freedom (1.0 for none)."""
    if dof == 0:
        return 1.0
    half = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def homogeneity(
    reference: dict[int, Counter], candidate: dict[int, Counter], min_expected=MIN_EXPECTED
) -> Homogeneity:
    """One chi-square test over every prompt (the keys of ``reference``, all in
    ``candidate``): the prompts' statistics and degrees of freedom summed."""
    statistic, dof = 0.0, 0
    for prompt, counts in reference.items():
        table = pooled_table(counts, candidate[prompt], min_expected)
        part, part_dof = chi_square(table)
        statistic, dof = statistic + part, dof + part_dof
    return Homogeneity(chi_square_p_value(statistic, dof), statistic, dof)
