"""tools/sts_ceiling.py: what temperatures can reach, on verify records with a known truth."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from sts_ceiling import noise_floor, split_by_prompt, study  # noqa: E402

K = 3


def records(scale: float, steps: int = 20_000, seed: int = 0, shift: float = 0.0):
    """Verify records whose confidence logits are the true ones times ``scale`` (1: a
    calibrated head; 2: overconfident, which temperature 2 undoes), plus ``shift``."""
    rng = np.random.default_rng(seed)
    true_logits = rng.normal(0.5, 1.5, (steps, K))
    accepted = rng.random((steps, K)) < 1 / (1 + np.exp(-true_logits))
    return true_logits * scale + shift, accepted, rng.integers(0, 100, steps)


def test_a_calibrated_head_sits_at_the_noise_floor_and_keeps_temperature_one():
    logits, accepted, prompts = records(scale=1.0)
    found = study(logits, accepted, prompts, [1.0] * K, splits=1)
    assert found["sts_in_sample"]["temperatures"] == pytest.approx([1.0] * K, abs=0.1)
    floor = found["noise_floor_same_steps"]
    assert all(0 < f < 0.02 for f in floor)
    assert found["ece_temperature_1"] == pytest.approx(floor, abs=0.01)


def test_an_overconfident_head_is_fixed_by_its_temperature_in_and_out_of_sample():
    logits, accepted, prompts = records(scale=2.0)
    found = study(logits, accepted, prompts, [1.0] * K, splits=2)
    assert found["sts_in_sample"]["temperatures"] == pytest.approx([2.0] * K, rel=0.15)
    assert min(found["ece_temperature_1"]) > 0.04
    assert max(found["sts_fit_on_half_scored_on_other_half"]) < 0.02
    # The reliability table shows the overconfidence: low predictions come true more often.
    low = found["reliability_checkpoint_temperatures"][0][0]
    assert low["observed"] > low["predicted"]


def test_a_biased_head_needs_platts_bias_where_a_temperature_falls_short():
    """Logits 1.5 too high: no temperature undoes a shift, a bias of -1.5 does."""
    logits, accepted, prompts = records(scale=1.0, shift=1.5)
    found = study(logits, accepted, prompts, [1.0] * K, splits=1)
    platt = found["platt_in_sample"]
    assert platt["biases"][0] == pytest.approx(-1.5, abs=0.2)
    assert max(platt["ece"]) < 0.02 < min(found["sts_in_sample"]["ece"])


def test_halves_split_prompts_not_steps():
    prompts = np.repeat(np.arange(10), 5)
    half = split_by_prompt(prompts, seed=1)
    assert half.sum() == 25
    assert all(len(set(half[prompts == p])) == 1 for p in range(10))


def test_noise_floor_shrinks_with_more_steps():
    predicted = np.cumprod(np.full((1000, K), 0.7), axis=1)
    few = noise_floor(predicted[:200], draws=50)
    many = noise_floor(predicted, draws=50)
    assert all(m < f for m, f in zip(many, few, strict=True))


def test_online_sts_replay_recovers_an_overconfident_heads_temperature():
    from refit_confidence_head import online_sts

    from lab.tiny_pair.calibration import calibration_report

    logits, accepted, _ = records(scale=2.0, steps=40_000)
    temperatures, refits = online_sts(logits, accepted, steps=2000, rows=16, seed=0)
    assert refits == 2000 // 256
    # Every row is a survival trial at every position (all drafts verified); the prior
    # (temperature 1) keeps ~10% of the weight.
    assert all(1.6 < t < 2.3 for t in temperatures)
    fresh_logits, fresh_accepted, _ = records(scale=2.0, steps=40_000, seed=3)
    fitted = calibration_report(fresh_logits, fresh_accepted, temperatures)["ece_sts"]
    assert (
        max(fitted)
        < 0.015
        < 0.05
        < min(calibration_report(fresh_logits, fresh_accepted, [1.0] * K)["ece_sts"])
    )
    calibrated, _ = online_sts(logits / 2.0, accepted, steps=2000, rows=16, seed=0)
    assert calibrated == pytest.approx([1.0] * K, abs=0.1)


def test_heldout_windows_come_from_held_out_files_and_skip_the_excluded():
    from refit_confidence_head import PROMPT_LEN, heldout_windows

    first = heldout_windows(8, half=0, seed=0, exclude=set())
    assert first.shape == (8, PROMPT_LEN) and first.dtype == np.int64
    np.testing.assert_array_equal(first, heldout_windows(8, half=0, seed=0, exclude=set()))
    # Excluding a window replaces it; the other half of the files gives other windows.
    again = heldout_windows(8, half=0, seed=0, exclude={tuple(first[0].tolist())})
    assert tuple(first[0].tolist()) not in {tuple(w.tolist()) for w in again}
    np.testing.assert_array_equal(again[:7], first[1:])
    other = heldout_windows(8, half=1, seed=0, exclude=set())
    assert not {tuple(w.tolist()) for w in other} & {tuple(w.tolist()) for w in first}
