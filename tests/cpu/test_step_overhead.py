"""The step's time outside the SPS curve, and what it changes in sps and the draft gate."""

import numpy as np
import pytest
import torch

from vllm_dspark.capacity.allocation import sps_best_count, sps_table_from_curve
from vllm_dspark.capacity.draft_gate import DraftGate, draft_seconds_table
from vllm_dspark.capacity.step_overhead import WINDOW, StepOverhead, fit_overhead

CPU = torch.device("cpu")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(overhead: StepOverhead, clock: FakeClock, periods_ms, forward_ms, draft_ms):
    for period in periods_ms:
        clock.now += period / 1000.0
        overhead.observe(64, forward_ms / 1000.0, draft_ms / 1000.0)


def test_the_estimate_is_the_rest_of_the_period_a_window_late():
    clock = FakeClock()
    overhead = StepOverhead(CPU, clock=clock)
    overhead.observe(64, 0.003, 0.001)  # the first proposal only starts the clock
    # Steps of 5 ms with a 3 ms forward and a 1 ms proposal leave 1 ms; one outlier.
    run_steps(overhead, clock, [5.0] * (WINDOW - 1) + [50.0], 3.0, 1.0)
    assert overhead.seconds == 0.0  # the first window's value is still on its way
    run_steps(overhead, clock, [7.0] * WINDOW, 3.0, 1.0)
    assert overhead.seconds == pytest.approx(1e-3)  # the outlier does not count
    assert overhead.per_draft_seconds == 0.0  # the drafts never varied
    run_steps(overhead, clock, [7.0] * WINDOW, 3.0, 1.0)
    assert overhead.seconds == pytest.approx(3e-3)


def test_the_fit_splits_the_rest_into_per_step_and_per_draft_time():
    # 1 ms per step and 10 us per verified draft, over admissions of 0 to 620 drafts.
    drafts = np.arange(WINDOW, dtype=np.float64) * 20
    fixed, per_draft = fit_overhead(drafts, 1e-3 + 1e-5 * drafts)
    assert fixed == pytest.approx(1e-3, rel=1e-3)
    assert per_draft == pytest.approx(1e-5, rel=1e-3)
    # An outlier (a pause between steps) does not move it; nor can either go negative.
    residuals = 1e-3 + 1e-5 * drafts
    residuals[5] = 0.5
    assert fit_overhead(drafts, residuals) == pytest.approx((1e-3, 1e-5), rel=1e-3)
    assert fit_overhead(drafts, 5e-3 - 1e-5 * drafts)[1] == 0.0


def test_the_measurement_follows_the_admission():
    clock = FakeClock()
    overhead = StepOverhead(CPU, clock=clock)
    overhead.observe(0, 0.0, 0.0)
    for step in range(2 * WINDOW):
        drafts = step % 8 * 16
        clock.now += 0.004 + 0.001 + 2e-5 * drafts  # forward 4 ms, the rest 1 ms + 20 us/draft
        overhead.observe(drafts, 0.004, 0.0)
    assert overhead.seconds == pytest.approx(1e-3, rel=1e-3)  # the ridge biases a little
    assert overhead.per_draft_seconds == pytest.approx(2e-5, rel=1e-3)


def test_steps_the_curve_does_not_describe_are_left_out():
    clock = FakeClock()
    overhead = StepOverhead(CPU, clock=clock)
    for _ in range(3 * WINDOW):
        clock.now += 0.100  # a prefill step: long, and not a sample
        overhead.observe(None, 0.0, 0.0)
    assert overhead.seconds == 0.0


def test_a_given_overhead_is_never_measured():
    clock = FakeClock()
    overhead = StepOverhead(CPU, fixed_seconds=0.002, clock=clock)
    run_steps(overhead, clock, [50.0] * (3 * WINDOW), 3.0, 1.0)
    assert overhead.seconds == 0.002


def test_ranks_with_different_clocks_plan_with_the_same_value():
    # Rank 0 measures 0.5 s, rank 1 0.75 s (binary fractions: exact); the device reduction
    # (faked: each rank's collective sees the other's value) gives both the larger.
    def reduce_with(other_s):
        return lambda tensor: tensor[0].clamp_(min=other_s)

    clocks = [FakeClock(), FakeClock()]
    ranks = [
        StepOverhead(CPU, reduce_max=reduce_with(other), clock=clock)
        for other, clock in zip((0.75, 0.5), clocks, strict=True)
    ]
    for rank, clock, period in zip(ranks, clocks, (1000.0, 1250.0), strict=True):
        rank.observe(64, 0.5, 0.0)
        run_steps(rank, clock, [period] * (2 * WINDOW), 500.0, 0.0)
    assert ranks[0].seconds == ranks[1].seconds == 0.75


def test_overhead_makes_sps_admit_what_a_bare_curve_refuses():
    # 4 requests, K = 4, each draft 70% likely to survive after the previous one.
    survival = torch.tensor([0.7, 0.49, 0.34, 0.24]).repeat(4, 1)
    # The forward doubles in time from 4 to 5 tokens: on the curve alone, no draft pays.
    curve = sps_table_from_curve([(1, 1000.0), (4, 1000.0), (5, 500.0)], 20)
    assert sps_best_count(survival, curve).item() == 0
    # With 4 ms per step outside the forward (host-bound), verifying drafts pays.
    admitted = sps_best_count(survival, curve, fixed_seconds=0.004).item()
    assert admitted >= 4
    # Equal survivals admit in order, so more overhead never admits fewer.
    more = sps_best_count(survival, curve, fixed_seconds=0.04).item()
    assert more >= admitted


def test_overhead_opens_the_draft_gate_on_a_host_bound_step():
    tokens = torch.arange(256 * 8 + 1, dtype=torch.float64)
    sps = 1000.0 / (0.1 + 0.01 * tokens)  # a tiny target: its forward is almost free
    gate = DraftGate(sps, {7: draft_seconds_table([(1, 0.3), (256, 1.0)], 256)})
    survival = [0.7, 0.5, 0.35, 0.25, 0.17, 0.12, 0.08]
    # The curve alone: a 0.3 ms proposal against a 0.11 ms forward never pays.
    assert not gate.decide(1, survival, 7)
    # A step that really takes 2.8 ms (2.7 ms outside the forward): drafting pays.
    assert gate.decide(1, survival, 7, overhead_s=0.0027)
    # ...unless each verified draft costs more host time than its expected token returns.
    assert not DraftGate(sps, gate.draft_seconds).decide(
        1, survival, 7, overhead_s=0.0027, per_draft_s=0.004
    )


def test_per_draft_time_limits_what_sps_admits():
    survival = torch.tensor([0.95, 0.6, 0.3, 0.1]).repeat(4, 1)
    flat = sps_table_from_curve([(1, 1000.0), (64, 1000.0)], 20)
    # A flat curve and 4 ms per step: every draft pays.
    assert sps_best_count(survival, flat, fixed_seconds=0.004).item() == 16
    # At 1 ms per verified draft only the likeliest do: about survival > step / (R + E).
    capped = sps_best_count(survival, flat, 0.004, per_draft_seconds=0.001).item()
    assert capped == 4


def test_sps_varies_a_saturated_admission_now_and_then(engine_config, model_dirs):
    from test_compact_verification import K, build_speculator

    from vllm_dspark.capacity.control import EXPLORE_EVERY

    curve = [[1, 200.0], [512, 50.0]]
    measuring = build_speculator(
        engine_config, model_dirs, dspark_capacity="sps", dspark_sps_curve=curve
    )
    budgets = [measuring.admission_budget(16) for _ in range(2 * EXPLORE_EVERY)]
    half = [i for i, budget in enumerate(budgets) if budget != 16 * K]
    assert half == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert budgets[EXPLORE_EVERY - 1] == 16 * K // 2
    # With the overhead given, nothing is measured and nothing varied.
    given = build_speculator(
        engine_config,
        model_dirs,
        dspark_capacity="sps",
        dspark_sps_curve=curve,
        dspark_step_overhead_ms=1.5,
    )
    assert {given.admission_budget(16) for _ in range(2 * EXPLORE_EVERY)} == {16 * K}
    assert given.step_overhead.seconds == 0.0015
