"""The statistics of the sampled-losslessness GPU test (tests/sampling_stats.py), on
synthetic samples: one distribution passes, a shifted one fails, and the p-values are
calibrated."""

from collections import Counter

import numpy as np
import pytest
from sampling_stats import (
    MIN_EXPECTED,
    bin_first_tokens,
    chi_square,
    chi_square_p_value,
    homogeneity,
    pooled_table,
)

# A long-tailed distribution over 300 three-token continuations, as a small model's first
# tokens at temperature 1 are: a few likely ones, many rare ones.
BINS = [(i // 30, i % 30, 7) for i in range(300)]
PROBS = 1.0 / np.arange(1, 301) ** 1.2
PROBS /= PROBS.sum()


def draw(rng, probs, count: int) -> list[list[int]]:
    return [list(BINS[i]) for i in rng.choice(len(BINS), size=count, p=probs)]


def samples(rng, probs, prompts: int, per_prompt: int) -> dict[int, Counter]:
    outputs = [tokens for _ in range(prompts) for tokens in draw(rng, probs, per_prompt)]
    prompt_of = [p for p in range(prompts) for _ in range(per_prompt)]
    return bin_first_tokens(outputs, prompt_of, 3)


def test_the_p_value_is_the_chi_square_survival_function():
    # Textbook 5% critical values.
    assert chi_square_p_value(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi_square_p_value(11.070498, 5) == pytest.approx(0.05, abs=1e-6)
    assert chi_square_p_value(0.0, 4) == 1.0
    assert chi_square_p_value(123.0, 0) == 1.0


def test_pearsons_statistic_of_a_small_table():
    statistic, dof = chi_square(np.array([[10.0, 20.0], [20.0, 10.0]]))
    assert (statistic, dof) == (pytest.approx(4 * 25 / 15), 1)
    assert chi_square(np.array([[40.0], [35.0]])) == (0.0, 0)


def test_rare_bins_are_pooled_and_no_sample_is_lost():
    reference = Counter({"a": 500, "b": 300, "c": 3, "d": 2, "e": 1})
    candidate = Counter({"a": 480, "b": 310, "c": 4, "d": 2, "f": 2})
    table = pooled_table(reference, candidate)
    assert table.shape == (2, 3)  # a, b, and c-f pooled
    assert table.sum(1).tolist() == [806, 798]
    expected = np.outer(table.sum(1), table.sum(0)) / table.sum()
    assert (expected >= MIN_EXPECTED).all()
    # A pooled bin too small on its own joins the smallest kept bin.
    table = pooled_table(Counter({"a": 500, "b": 300, "c": 1}), Counter({"a": 480, "b": 310}))
    assert table.tolist() == [[500, 301], [480, 310]]


def test_short_outputs_are_refused():
    with pytest.raises(ValueError, match="fewer than 3"):
        bin_first_tokens([[1, 2, 3], [4, 5]], [0, 0], 3)


def test_samples_of_one_distribution_pass():
    rng = np.random.default_rng(0)
    reference = samples(rng, PROBS, prompts=4, per_prompt=5000)
    result = homogeneity(reference, samples(rng, PROBS, prompts=4, per_prompt=5000))
    assert result.p_value > 0.01
    assert result.dof > 4 * 50  # the rare tail pooled, the common bins kept


def test_a_distribution_sampled_at_temperature_0_9_fails():
    sharper = PROBS ** (1 / 0.9)
    sharper /= sharper.sum()
    rng = np.random.default_rng(0)
    reference = samples(rng, PROBS, prompts=4, per_prompt=5000)
    assert homogeneity(reference, samples(rng, sharper, prompts=4, per_prompt=5000)).p_value < 1e-6


def test_three_points_moved_between_the_two_likeliest_bins_fail():
    shifted = PROBS.copy()
    shifted[0] -= 0.03
    shifted[1] += 0.03
    rng = np.random.default_rng(0)
    reference = samples(rng, PROBS, prompts=4, per_prompt=5000)
    assert homogeneity(reference, samples(rng, shifted, prompts=4, per_prompt=5000)).p_value < 1e-3


def test_p_values_under_one_distribution_are_calibrated():
    """Pooling keeps the test's size: about 5% of same-distribution comparisons fall below
    p = 0.05."""
    rng = np.random.default_rng(1)
    p_values = [
        homogeneity(samples(rng, PROBS, 2, 1000), samples(rng, PROBS, 2, 1000)).p_value
        for _ in range(300)
    ]
    assert 0.02 <= np.mean(np.array(p_values) < 0.05) <= 0.09
