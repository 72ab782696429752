"""Online STS: refits temperatures from served verification results, deterministically."""

import pytest
import torch

from lab.tiny_pair.calibration import expected_calibration_error
from vllm_dspark.capacity.online_sts import OnlineSTS

K = 3


def serve(sts, steps, true_temperatures, gen, reqs=256, temperatures=None, verified=K):
    """Steps where every request verifies its first ``verified`` drafts, each accepted with
    sigmoid(z / true T) given its prefix was."""
    temperatures = torch.ones(K) if temperatures is None else temperatures
    for _ in range(steps):
        logits = torch.randn(reqs, K, generator=gen) * 3
        accept = torch.rand(reqs, K, generator=gen) < torch.sigmoid(logits / true_temperatures)
        num_accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1).clamp(max=verified)
        sts.observe(logits, torch.full((reqs,), verified), num_accepted, temperatures)
        sts.maybe_refit(temperatures)


def test_refit_finds_the_temperatures_that_calibrate_the_survival():
    truth = torch.tensor([2.0, 0.7, 1.0])
    # Later positions' prefix bins hold survivals under the temperatures of their step:
    # a few refits reach the fixed point.
    sts = OnlineSTS(torch.ones(K), refit_every=64, decay=0.99, prior_weight=10.0)
    temperatures = torch.ones(K)
    serve(sts, 512, truth, torch.Generator().manual_seed(0), temperatures=temperatures)
    assert sts.refits == 8
    assert temperatures.tolist() == pytest.approx(truth.tolist(), rel=0.15)
    assert max(sts.calibration_error) < 0.01
    # On fresh steps the survival these temperatures predict is calibrated.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(100_000, K, generator=gen) * 3
    survived = torch.cumprod(
        (torch.rand(100_000, K, generator=gen) < torch.sigmoid(logits / truth)).long(), dim=1
    )
    predicted = torch.cumprod(torch.sigmoid(logits / temperatures), dim=1)
    for k in range(K):
        ece = expected_calibration_error(predicted[:, k].numpy(), survived[:, k].numpy())
        assert ece < 0.01, (k, ece)


def test_a_miscalibrated_later_position_is_fitted_on_the_survival_not_alone():
    # Position 1 is overconfident (true T 2) and stays at the prior (huge prior weight is
    # not possible per position, so a prior of 2 for it): position 2's fit then sees the
    # right prefix survivals and finds its own temperature.
    truth = torch.tensor([2.0, 1.5, 1.0])
    sts = OnlineSTS(torch.tensor([2.0, 1.0, 1.0]), refit_every=64, decay=0.99, prior_weight=10.0)
    temperatures = torch.tensor([2.0, 1.0, 1.0])
    serve(sts, 512, truth, torch.Generator().manual_seed(1), temperatures=temperatures)
    assert temperatures.tolist() == pytest.approx(truth.tolist(), rel=0.15)


def test_few_trials_stay_near_the_prior_and_unknown_survivals_are_censored():
    sts = OnlineSTS(torch.ones(K), refit_every=1, prior_weight=1e6)
    temperatures = torch.ones(K)
    serve(sts, 1, torch.tensor([3.0, 3.0, 3.0]), torch.Generator(), temperatures=temperatures)
    assert temperatures.tolist() == pytest.approx([1.0] * K, abs=0.01)
    # Nothing verified: no trial anywhere, whatever was accepted before.
    empty = OnlineSTS(torch.ones(K))
    empty.observe(
        torch.zeros(4, K), torch.zeros(4, dtype=torch.long), torch.zeros(4), torch.ones(K)
    )
    assert empty.trials.sum() == 0
    # One draft verified: accepted, the later positions are unknown; rejected, no later
    # prefix survives, so every position is a trial (and a miss).
    sts = OnlineSTS(torch.ones(K))
    one = torch.ones(2, dtype=torch.long)
    sts.observe(torch.zeros(2, K), one, torch.tensor([1, 0]), torch.ones(K))
    assert sts.trials.sum(dim=1).tolist() == [2.0, 1.0, 1.0]
    assert sts.hits.sum(dim=1).tolist() == [1.0, 0.0, 0.0]
    # The prefix sums hold s_{k-1} = 0.5^(k-1) for z = 0 at temperature 1.
    assert sts.prefix_sums.sum(dim=1).tolist() == [2.0, 0.5, 0.25]


def test_ranks_fed_alike_fit_bit_identical_temperatures():
    fits = []
    for _ in range(2):
        sts = OnlineSTS(torch.tensor([1.0, 1.2, 0.9]), refit_every=16)
        temperatures = torch.ones(K)
        serve(
            sts,
            32,
            torch.tensor([1.5, 1.0, 2.0]),
            torch.Generator().manual_seed(7),
            64,
            temperatures,
        )
        fits.append(temperatures)
    assert torch.equal(fits[0], fits[1])


def test_warm_prompt_variants_are_cut_prompts_and_reproducible():
    from online_sts_convergence import warm_prompts  # benchmarks/ is on the path

    pool = [list(range(100 * i, 100 * i + 64)) for i in range(5)]
    variants = warm_prompts(pool, 50, seed=3)
    assert len(variants) == 50 and variants == warm_prompts(pool, 50, seed=3)
    assert all(16 <= len(v) <= 64 and v == pool[v[0] // 100][: len(v)] for v in variants)
    assert len({len(v) for v in variants}) > 10 and variants != warm_prompts(pool, 50, seed=4)


def test_divergences_name_the_first_differing_position_and_its_top_two_gap():
    from types import SimpleNamespace

    from online_sts_convergence import divergences

    def top_two(first, second):  # vLLM's {token: Logprob} at one position
        return {5: SimpleNamespace(logprob=first), 9: SimpleNamespace(logprob=second)}

    reference = [[1, 2, 3], [4, 5, 6]]
    logprobs = [[top_two(-0.1, -3.0)] * 3, [top_two(-0.5, -2.0), top_two(-0.7, -0.7001)] * 2]
    found = divergences([[1, 2, 3], [4, 8, 6]], reference, logprobs)
    assert found == [{"prompt": 1, "position": 1, "top_two_gap": pytest.approx(1e-4)}]


def test_the_speculator_feeds_its_verifications_and_temperatures(plugin_speculator):
    """``dspark_online_sts`` in the speculator: each real step's verified and accepted
    drafts, against the confidence logits proposed for those slots, under the temperatures
    in use; a refit writes the temperatures the captured graphs read."""
    from types import SimpleNamespace

    speculator = plugin_speculator(3, dspark_capacity="budget", dspark_budget_frac=1.0)
    speculator.temperatures = torch.ones(3)  # what loading the draft model sets
    speculator.online_sts = OnlineSTS(speculator.temperatures.clone(), refit_every=2)
    speculator.record_calibration(False)  # as loading does: online STS reads every step
    speculator.controller.drafted_last, speculator.controller.draft_depth = True, 3
    speculator.slot_confidence_logits[:2] = torch.tensor([[4.0, 4.0, 4.0], [-4.0, -4.0, -4.0]])
    batch = SimpleNamespace(
        num_reqs=2, cu_num_logits=torch.tensor([0, 4, 8]), idx_mapping=torch.tensor([1, 0])
    )
    # Slot 1 (confident to reject) accepted all three, slot 0 (confident) none.
    temperatures = speculator.temperatures
    for _ in range(2):
        speculator.controller._observe_real_step(batch, torch.tensor([4, 1]))
    sts = speculator.online_sts
    assert sts.steps == 2 and sts.refits == 1 and sts.fitted_at_step == 2
    # Two rows a step, every position's survival known; the second step's counts decayed.
    assert sts.trials.sum(dim=1).tolist() == pytest.approx([2 + 2 * 0.999] * 3)
    assert sts.hits.sum(dim=1).tolist() == pytest.approx([1 + 0.999] * 3)
    # Confidences that said the opposite of what happened: the fit flattens them.
    assert speculator.temperatures is temperatures and (temperatures > 1.0).all()
