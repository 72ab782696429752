import pytest
import torch

from vllm_dspark.capacity.calibration_stats import CalibrationStats, _binned_auroc

K = 3


def simulate(stats, survival, gen, calibrated=True):
    """Verify all K drafts: draft k is accepted with probability c_k (or c_k^3)."""
    conditional = survival / torch.cat([torch.ones(len(survival), 1), survival[:, :-1]], 1)
    truth = conditional if calibrated else conditional**3
    accepted_each = torch.rand(truth.shape, generator=gen) < truth
    num_accepted = torch.cumprod(accepted_each.long(), dim=1).sum(dim=1)
    stats.observe(survival, torch.full((len(survival),), K), num_accepted)


def random_survival(n, gen):
    return torch.cumprod(torch.rand(n, K, generator=gen) * 0.6 + 0.4, dim=1)


def test_calibrated_predictions_have_small_ece_and_informative_auroc():
    gen = torch.Generator().manual_seed(0)
    stats = CalibrationStats(K, torch.device("cpu"))
    simulate(stats, random_survival(20_000, gen), gen)
    summary = stats.summary()
    for kind in ("conditional", "prefix"):
        assert max(summary[kind].ece) < 0.03, kind
        assert min(summary[kind].auroc) > 0.55, kind
    assert summary["prefix"].trials == [20_000] * K
    # Conditional trials shrink with the accepted prefix.
    assert summary["conditional"].trials[0] == 20_000 > summary["conditional"].trials[2]
    # A calibrated head's ECE is its noise floor, up to the floor's own spread; the floor
    # falls as trials grow (~1 / sqrt(n)).
    for kind in ("conditional", "prefix"):
        floors, eces = summary[kind].ece_noise_floor, summary[kind].ece
        assert all(0.002 < f < 0.02 for f in floors), (kind, floors)
        assert eces == pytest.approx(floors, abs=0.01), kind
    small = CalibrationStats(K, torch.device("cpu"))
    simulate(small, random_survival(2_000, gen), gen)
    few = small.summary()["prefix"].ece_noise_floor
    many = summary["prefix"].ece_noise_floor
    assert all(a > 2 * b for a, b in zip(few, many, strict=True))


def test_miscalibration_shows_in_ece():
    gen = torch.Generator().manual_seed(1)
    stats = CalibrationStats(K, torch.device("cpu"))
    simulate(stats, random_survival(20_000, gen), gen, calibrated=False)
    summary = stats.summary()["conditional"]
    assert min(summary.ece) > 0.1
    assert max(summary.ece_noise_floor) < 0.03  # the floor is the outcomes', not the head's


def test_unverified_positions_are_censored_not_counted_as_rejections():
    stats = CalibrationStats(K, torch.device("cpu"))
    survival = torch.tensor([[0.9, 0.8, 0.7], [0.9, 0.8, 0.7]])
    # Request 0: one draft verified and accepted; request 1: two verified, first rejected.
    stats.observe(survival, torch.tensor([1, 2]), torch.tensor([1, 0]))
    summary = stats.summary()
    assert summary["conditional"].trials == [2, 0, 0]
    assert summary["conditional"].mean_observed[0] == 0.5
    assert summary["prefix"].trials == [0, 0, 0]  # nobody had all K verified


def test_counts_do_not_depend_on_batch_order():
    gen = torch.Generator().manual_seed(2)
    survival = random_survival(500, gen)
    accepted = torch.randint(0, K + 1, (500,), generator=gen)
    a, b = CalibrationStats(K, torch.device("cpu")), CalibrationStats(K, torch.device("cpu"))
    order = torch.randperm(500, generator=gen)
    for stats, idx in ((a, torch.arange(500)), (b, order)):
        stats.observe(survival[idx], torch.full((500,), K), accepted[idx])
    for name in ("trials", "hits", "predicted"):
        assert torch.equal(getattr(a.conditional, name), getattr(b.conditional, name))


@pytest.mark.parametrize(
    "pos,neg,expected", [([0, 0, 5], [5, 0, 0], 1.0), ([5, 0, 0], [0, 0, 5], 0.0), ([2], [2], 0.5)]
)
def test_binned_auroc(pos, neg, expected):
    assert _binned_auroc(torch.tensor(pos).double(), torch.tensor(neg).double()) == expected


def test_ece_and_auroc_follow_the_trainers_definitions():
    """Same ECE (15 equal-width bins) as the trainer's STS objective; AUROC within the
    tie error of 150 bins of the exact one."""
    import numpy as np

    from lab.tiny_pair.calibration import auroc, expected_calibration_error

    gen = torch.Generator().manual_seed(3)
    survival = random_survival(20_000, gen)
    stats = CalibrationStats(K, torch.device("cpu"))
    conditional = survival / torch.cat([torch.ones(20_000, 1), survival[:, :-1]], 1)
    accepted_each = torch.rand(conditional.shape, generator=gen) < conditional**2
    num_accepted = torch.cumprod(accepted_each.long(), dim=1).sum(dim=1)
    stats.observe(survival, torch.full((20_000,), K), num_accepted)
    prefix = stats.summary()["prefix"]
    events = (torch.arange(K) < num_accepted[:, None]).numpy()
    for k in range(K):
        scores = survival[:, k].double().numpy()
        assert prefix.ece[k] == pytest.approx(
            expected_calibration_error(scores, events[:, k]), abs=1e-6
        )
        assert prefix.auroc[k] == pytest.approx(auroc(scores, events[:, k]), abs=0.005)
    assert np.isfinite(prefix.ece).all()
