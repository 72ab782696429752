"""The proposal-statistics kernel computes what the PyTorch definitions say (Triton's
interpreter, :mod:`triton_interpreter`; on a GPU, tests/gpu/test_capacity_kernels_gpu.py)."""

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.capacity.allocation import (
    UNCOMPUTED_SURVIVAL,
    prefix_survival,
    sps_best_count,
    sps_table_from_curve,
    threshold_count,
)

K, MAX_NUM_REQS = 7, 24
# (requests, O + a R, b, C): with C, full admission (no premium) against compacted ones.
CASES = [
    (1, 0.0, 0.0, 0.0),
    (3, 0.002, 0.0, 0.0),
    (16, 0.001, 2e-5, 0.0),
    (24, 0.0, 0.0, 0.0),
    (24, 0.004, 1e-4, 0.0),
    (16, 0.001, 2e-5, 0.003),
    (24, 0.0, 0.0, 0.05),
]


def test_kernel_under_triton_interpreter():
    assert run_interpreted(__file__) == len(CASES) + 3


def survivals(num_reqs: int, generator: torch.Generator) -> torch.Tensor:
    """Prefix survivals of random confidences, some positions uncomputed (dynamic depth),
    in the first rows of a larger buffer (as the speculator keeps them)."""
    buffer = torch.full((MAX_NUM_REQS, K), 7.0)
    logits = torch.randn(num_reqs, K, generator=generator) * 2 + 1
    survival = prefix_survival(logits, torch.ones(K))
    survival[: num_reqs // 3, 5:] = UNCOMPUTED_SURVIVAL
    buffer[:num_reqs] = survival
    return buffer[:num_reqs]


def check_kernel_against_definitions(case, device: torch.device) -> None:
    """Also run on a GPU by tests/gpu/test_capacity_kernels_gpu.py."""
    from vllm_dspark.capacity.proposal_kernel import proposal_stats

    num_reqs, fixed, per_draft, compaction = case
    survival = survivals(num_reqs, torch.Generator().manual_seed(num_reqs))
    curve = [(1, 250.0), (16, 240.0), (64, 200.0), (200, 90.0)]
    table = sps_table_from_curve(curve, MAX_NUM_REQS * (1 + K))
    stats = proposal_stats(
        survival.to(device), table.to(device), fixed, per_draft, compaction, 0.4, MAX_NUM_REQS
    )
    wanted = sps_best_count(survival, table, fixed, per_draft, compaction)
    assert stats.sps_count.item() == wanted
    if compaction >= 0.05:  # dearer than any compacted admission could gain: all of them
        assert wanted == num_reqs * K
    assert stats.threshold_count.item() == threshold_count(survival, 0.4)
    sums = survival.clamp(min=0).sum(dim=0)
    assert torch.allclose(stats.position_sums.cpu(), sums, rtol=1e-6)


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_matches_the_definitions(case):
    check_kernel_against_definitions(case, torch.device("cpu"))


@interpreted
def test_interpreted_kernel_without_an_sps_table_counts_the_threshold():
    from vllm_dspark.capacity.proposal_kernel import proposal_stats

    survival = survivals(5, torch.Generator().manual_seed(0))
    stats = proposal_stats(survival, None, 0.0, 0.0, 0.0, 0.4, MAX_NUM_REQS)
    assert stats.position_sums.shape == (K,)
    assert stats.threshold_count.item() == threshold_count(survival, 0.4)


def check_records(plugin_speculator, mode: str) -> None:
    """What a proposal records for the steps after it: the budget's wanted count and the
    draft gate's per-position survival, read back one proposal later."""
    options = {"dspark_capacity": mode}
    if mode == "sps":
        options |= {"dspark_sps_curve": [[1, 250.0], [64, 200.0], [200, 90.0]]}
        options["dspark_step_overhead_ms"] = 1.0
    else:
        options["dspark_confidence_threshold"] = 0.4
    speculator = plugin_speculator(**options)
    num_reqs = 16
    if mode == "sps":
        speculator.controller.set_draft_cost({K: [(1, 0.5), (64, 2.0)]})
    survival = survivals(num_reqs, torch.Generator().manual_seed(3))
    speculator.controller.record_proposal(survival)
    speculator.controller.record_proposal(survival * 0.5)  # the next proposal's, not read yet
    if mode == "sps":
        fixed = 1e-3 + speculator.controller._draft_seconds(num_reqs)
        wanted = sps_best_count(survival, speculator.controller.sps_table, fixed)
        gate = speculator.controller.stale_survival.per_request()
        assert gate == pytest.approx((survival.clamp(min=0).sum(dim=0) / num_reqs).tolist())
    else:
        wanted = threshold_count(survival, 0.4)
    assert speculator.controller.stale_budget.per_request() == pytest.approx(int(wanted) / num_reqs)


@pytest.mark.parametrize("mode", ["sps", "threshold"])
def test_a_proposal_records_its_budget_and_survivals(plugin_speculator, mode):
    check_records(plugin_speculator, mode)


@interpreted
@pytest.mark.parametrize("mode", ["sps", "threshold"])
def test_interpreted_kernel_path_records_the_same(plugin_speculator, mode):
    check_records(plugin_speculator, mode)
