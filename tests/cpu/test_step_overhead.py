"""The step's time outside the SPS curve, and what it changes in sps and the draft gate."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dspark.capacity.allocation import sps_best_count, sps_table_from_curve
from vllm_dspark.capacity.controller import TimedStep
from vllm_dspark.capacity.draft_gate import DraftGate, draft_seconds_table
from vllm_dspark.capacity.plain_steps import PLAIN_BURST
from vllm_dspark.capacity.step_overhead import (
    WINDOW,
    DevicePeriods,
    HostPeriods,
    OverheadFit,
    StepOverhead,
)

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
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    overhead.observe(64, 0.003, 0.001)  # the first proposal only starts the clock
    # Steps of 5 ms with a 3 ms forward and a 1 ms proposal leave 1 ms; one outlier.
    run_steps(overhead, clock, [5.0] * (WINDOW - 1) + [50.0], 3.0, 1.0)
    assert overhead.seconds == 0.0  # the first window's value is still on its way
    run_steps(overhead, clock, [7.0] * WINDOW, 3.0, 1.0)
    assert overhead.seconds == pytest.approx(1e-3)  # the outlier does not count
    assert overhead.per_draft_seconds == 0.0  # the drafts never varied
    # It follows a change within a few windows (earlier ones decay).
    run_steps(overhead, clock, [7.0] * WINDOW, 3.0, 1.0)
    assert 1e-3 < overhead.seconds < 3e-3
    run_steps(overhead, clock, [7.0] * (30 * WINDOW), 3.0, 1.0)
    assert overhead.seconds == pytest.approx(3e-3, rel=1e-2)


def fitted(drafts, residuals) -> tuple[float, float]:
    """(O, b) of a window at one batch size."""
    fit = OverheadFit()
    fit.add(np.full(len(drafts), 64.0), drafts, residuals)
    fixed, per_request, per_draft, skip, compaction = fit.estimate()
    assert per_request == pytest.approx(0.0, abs=1e-12)  # the batch size never varied
    assert skip == compaction == 0.0  # nothing was skipped, nor compacted
    return fixed, per_draft


def test_the_fit_splits_the_rest_into_per_step_and_per_draft_time():
    # 1 ms per step and 10 us per verified draft, over admissions of 0 to 620 drafts.
    drafts = np.arange(WINDOW, dtype=np.float64) * 20
    fixed, per_draft = fitted(drafts, 1e-3 + 1e-5 * drafts)
    assert fixed == pytest.approx(1e-3, rel=1e-3)
    assert per_draft == pytest.approx(1e-5, rel=1e-3)
    # An outlier (a pause between steps) does not move it; nor can either go negative.
    residuals = 1e-3 + 1e-5 * drafts
    residuals[5] = 0.5
    assert fitted(drafts, residuals) == pytest.approx((1e-3, 1e-5), rel=1e-3)
    assert fitted(drafts, 5e-3 - 1e-5 * drafts)[1] == 0.0
    # A window whose admission never varied keeps the slope earlier windows found.
    requests = np.full(WINDOW, 64.0)
    fit = OverheadFit()
    fit.add(requests, drafts, 1e-3 + 1e-5 * drafts)
    fit.add(requests, np.full(WINDOW, 300.0), np.full(WINDOW, 1e-3 + 1e-5 * 300))
    assert fit.estimate() == pytest.approx((1e-3, 0.0, 1e-5, 0.0, 0.0), rel=1e-3, abs=1e-12)


def test_the_fit_also_finds_the_time_per_request():
    # Serving: the batch size and the admission both move; 0.5 ms + 8 us per request +
    # 3 us per draft.
    rng = np.random.default_rng(0)
    requests = rng.integers(1, 256, WINDOW).astype(np.float64)
    drafts = np.floor(requests * rng.uniform(0, 7, WINDOW))
    fit = OverheadFit()
    fit.add(requests, drafts, 5e-4 + 8e-6 * requests + 3e-6 * drafts)
    assert fit.estimate() == pytest.approx((5e-4, 8e-6, 3e-6, 0.0, 0.0), rel=1e-2)


def test_the_fit_finds_what_a_skipped_proposal_costs():
    # Skipped proposals (no draft verified after them) cost 1.5 ms on top of the 1 ms every
    # step pays; drafted ones verify 16 to 112 drafts at 10 us each.
    rng = np.random.default_rng(1)
    skipped = (np.arange(WINDOW) % 3 == 0).astype(np.float64)
    drafts = np.where(skipped == 1, 0.0, rng.integers(16, 113, WINDOW))
    requests = np.full(WINDOW, 16.0)
    fit = OverheadFit()
    fit.add(requests, drafts, 1e-3 + 1e-5 * drafts + 1.5e-3 * skipped, skipped)
    fixed, _, per_draft, skip, _ = fit.estimate()
    assert (fixed, per_draft, skip) == pytest.approx((1e-3, 1e-5, 1.5e-3), rel=2e-2)


def test_the_fit_finds_what_compacting_costs():
    # Compacted steps (16 to 104 drafts of 16 x 7) cost 0.8 ms on top of the 1 ms every
    # step pays and 10 us per draft; a step verifying all 112 runs uncompacted.
    rng = np.random.default_rng(2)
    full = np.arange(WINDOW) % 4 == 0
    drafts = np.where(full, 112.0, rng.integers(16, 105, WINDOW))
    compacted = (~full).astype(np.float64)
    fit = OverheadFit()
    residuals = 1e-3 + 1e-5 * drafts + 8e-4 * compacted
    fit.add(np.full(WINDOW, 16.0), drafts, residuals, None, compacted)
    fixed, _, per_draft, skip, compaction = fit.estimate()
    assert (fixed, per_draft, compaction) == pytest.approx((1e-3, 1e-5, 8e-4), rel=2e-2)
    assert skip == 0.0


def test_the_measurement_follows_the_admission():
    clock = FakeClock()
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    overhead.observe(0, 0.0, 0.0)
    for step in range(2 * WINDOW):
        drafts = step % 8 * 16
        clock.now += 0.004 + 0.001 + 2e-5 * drafts  # forward 4 ms, the rest 1 ms + 20 us/draft
        overhead.observe(drafts, 0.004, 0.0)
    assert overhead.seconds == pytest.approx(1e-3, rel=1e-3)  # the ridge biases a little
    assert overhead.per_draft_seconds == pytest.approx(2e-5, rel=1e-3)


def test_the_measurement_follows_the_batch_size():
    clock = FakeClock()
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    overhead.observe(0, 0.0, 0.0, num_reqs=8)
    for step in range(4 * WINDOW):
        requests, drafts = 8 + step % 5 * 12, step % 8 * 16
        # forward 4 ms; the rest 1 ms + 10 us per request + 20 us per draft
        clock.now += 0.004 + 0.001 + 1e-5 * requests + 2e-5 * drafts
        overhead.observe(drafts, 0.004, 0.0, num_reqs=requests)
    assert overhead.seconds == pytest.approx(1e-3, rel=1e-2)
    assert overhead.per_request_seconds == pytest.approx(1e-5, rel=1e-2)
    assert overhead.per_draft_seconds == pytest.approx(2e-5, rel=1e-2)
    assert overhead.per_step_seconds(100) == pytest.approx(2e-3, rel=1e-2)


def test_steps_the_curve_does_not_describe_are_left_out():
    clock = FakeClock()
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    for _ in range(3 * WINDOW):
        clock.now += 0.100  # a prefill step: long, and not a sample
        overhead.observe(None, 0.0, 0.0)
    assert overhead.seconds == 0.0


def test_a_given_overhead_is_never_measured():
    clock = FakeClock()
    overhead = StepOverhead(CPU, fixed_seconds=0.002, periods=HostPeriods(clock))
    run_steps(overhead, clock, [50.0] * (3 * WINDOW), 3.0, 1.0)
    assert overhead.seconds == 0.002


def test_ranks_with_different_clocks_plan_with_the_same_value():
    # Rank 0 measures 0.5 s, rank 1 0.75 s. A fake collective: the second rank's call
    # completes it, writing the max into both ranks' tensors and refreshing rank 0's host
    # copy, which on a GPU stream runs after the collective anyway.
    ranks: list[StepOverhead] = []

    def reduce_max(tensor):
        if tensor is ranks[0]._device_value:
            return  # waits for its peer
        peer = ranks[0]
        torch.maximum(tensor, peer._device_value, out=tensor)
        peer._device_value.copy_(tensor)
        peer._host_value.copy_(tensor)

    clocks = [FakeClock(), FakeClock()]
    ranks += [
        StepOverhead(CPU, reduce_max=reduce_max, periods=HostPeriods(clock)) for clock in clocks
    ]
    for rank in ranks:
        rank.observe(64, 0.5, 0.0)
    for step in range(3 * WINDOW):  # in lockstep, rank 0 first, as the ranks' steps are
        compacted = step % 2 == 0  # every other step compacted: 0.1 s more on rank 0, 0.3 s
        costs = zip(ranks, clocks, (1.0, 1.25), (0.1, 0.3), strict=True)
        for rank, clock, period, premium in costs:
            clock.now += period + premium * compacted
            rank.observe(64, 0.5, 0.0, compacted=compacted)
    # (the ridge biases the fit by a few parts per million)
    assert ranks[0].seconds == ranks[1].seconds == pytest.approx(0.75, rel=1e-4)
    assert ranks[0].per_draft_seconds == ranks[1].per_draft_seconds
    assert ranks[0].compaction_seconds == ranks[1].compaction_seconds
    assert ranks[0].compaction_seconds == pytest.approx(0.3, rel=1e-4)


class FakeStream:
    """A device stream on a fake clock (ms): work enqueued runs after the work before it,
    and an event is done once the host's clock reaches the time the stream reaches it."""

    def __init__(self):
        self.host = 0.0  # the host's clock
        self.busy_until = 0.0  # when the stream finishes what was enqueued

    def enqueue(self, ms: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + ms

    def event_class(self):
        stream = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = max(stream.busy_until, stream.host)

            def query(self):
                return stream.host >= self.at

            def elapsed_time(self, end):
                return end.at - self.at

        return Event


@pytest.fixture
def fake_stream(monkeypatch) -> FakeStream:
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", stream.event_class())
    return stream


@pytest.mark.parametrize(("host_ms", "device_ms"), [(1.0, 5.0), (5.0, 1.0)])
def test_device_periods_time_each_step_as_the_stream_runs_it(fake_stream, host_ms, device_ms):
    """Device-bound (the host marks each step 1 ms after the last, its 5 ms of work queued
    behind) and host-bound (5 ms on the host, 1 ms on the device): every period is the
    slower of the two and comes back with its own step, in order, once done."""
    periods = DevicePeriods()
    read = periods.mark(None)
    for step in range(20):
        fake_stream.host += host_ms
        fake_stream.enqueue(device_ms)
        read += periods.mark(step)
    fake_stream.host += 1000.0  # the stream catches up
    read += periods.mark(None)
    assert [step for _, step in read] == list(range(20))
    # (The first also holds what the stream waited for the host's first step.)
    step_s = max(host_ms, device_ms) / 1e3
    assert [seconds for seconds, _ in read[1:]] == pytest.approx([step_s] * 19)


def test_device_periods_forget_what_a_stream_far_behind_has_not_run(fake_stream):
    periods = DevicePeriods(slots=8)
    read = periods.mark(None)
    for step in range(20):  # 20 steps of 5 ms marked at once: never done in time
        fake_stream.enqueue(5.0)
        read += periods.mark(step)
    fake_stream.host += 1000.0
    read += periods.mark(None)
    # The marks before each forgetting are gone; every period read is still one step's.
    assert 0 < len(read) < 19 and all(seconds == pytest.approx(5e-3) for seconds, _ in read)
    assert [step for _, step in read] == sorted(step for _, step in read)


def test_ranks_whose_streams_lag_differently_publish_at_the_same_step():
    """The reduction over ranks is a collective: each rank must publish at the same step
    whatever its stream has run. Rank 1 reads its periods three steps late."""

    class LatePeriods(HostPeriods):
        """Host periods handed out ``late`` marks after they end."""

        def __init__(self, clock, late):
            super().__init__(clock)
            self.late, self.waiting = late, []

        def mark(self, payload):
            self.waiting.append(super().mark(payload))
            return self.waiting.pop(0) if len(self.waiting) > self.late else []

    published = [[], []]
    clock = FakeClock()
    ranks = []
    for rank, late in enumerate((0, 3)):
        overhead = StepOverhead(CPU, periods=LatePeriods(clock, late))
        overhead._publish = lambda fitted, rank=rank: published[rank].append(fitted)
        ranks.append(overhead)
    marks = []
    for step in range(3 * WINDOW + 1):
        clock.now += 0.005
        for rank, overhead in enumerate(ranks):
            before = len(published[rank])
            overhead.observe(64, 0.003, 0.001)
            if len(published[rank]) > before:
                marks.append((rank, step))
    assert [step for rank, step in marks if rank == 0] == [step for rank, step in marks if rank]
    assert len(published[0]) == 3


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


def test_the_gate_prices_compacted_steps_with_their_premium():
    """A step after a skipped proposal is compacted to no draft, and so is a proposal's
    step verifying fewer than K drafts a request: both pay C; all K drafts do not."""
    tokens = torch.arange(256 * 8 + 1, dtype=torch.float64)
    sps = 1000.0 / (0.1 + 0.01 * tokens)
    gate = DraftGate(sps, {7: draft_seconds_table([(1, 0.3), (256, 1.0)], 256)})
    survival = [0.7, 0.5, 0.35, 0.25, 0.17, 0.12, 0.08]
    costs = {"overhead_s": 0.0027, "per_draft_s": 0.0}
    best, without = gate.gains(4, survival, 7, **costs)
    best_c, without_c = gate.gains(4, survival, 7, **costs, compaction_s=0.001)
    assert without_c == pytest.approx(4 / (4 / without + 0.001))
    assert best_c == pytest.approx(best)  # its best verifies all 7: uncompacted
    shallow, _ = gate.gains(4, survival, 3, **costs)
    shallow_c, _ = gate.gains(4, survival, 3, **costs, compaction_s=0.001)
    assert shallow_c < shallow  # 3 of 7 drafts: compacted


def test_per_draft_time_limits_what_sps_admits():
    survival = torch.tensor([0.95, 0.6, 0.3, 0.1]).repeat(4, 1)
    flat = sps_table_from_curve([(1, 1000.0), (64, 1000.0)], 20)
    # A flat curve and 4 ms per step: every draft pays.
    assert sps_best_count(survival, flat, fixed_seconds=0.004).item() == 16
    # At 1 ms per verified draft only the likeliest do: about survival > step / (R + E).
    capped = sps_best_count(survival, flat, 0.004, per_draft_seconds=0.001).item()
    assert capped == 4


def test_sps_varies_its_admission_now_and_then(plugin_speculator):
    from test_compact_verification import K

    from vllm_dspark.capacity.controller import EXPLORE_EVERY

    curve = [[1, 200.0], [512, 50.0]]
    measuring = plugin_speculator(dspark_capacity="sps", dspark_sps_curve=curve)
    budgets = [measuring.controller.admission_budget(16) for _ in range(2 * EXPLORE_EVERY)]
    half = [i for i, budget in enumerate(budgets) if budget != 16 * K]
    assert half == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert budgets[EXPLORE_EVERY - 1] == 16 * K // 2
    # With the overhead given, nothing is measured and nothing varied.
    given = plugin_speculator(
        dspark_capacity="sps",
        dspark_sps_curve=curve,
        dspark_step_overhead_ms=1.5,
    )
    assert {given.controller.admission_budget(16) for _ in range(2 * EXPLORE_EVERY)} == {16 * K}
    assert given.controller.step_overhead.seconds == 0.0015


def simulated_sps(plugin_speculator, curve, draft_s, **options):
    """A speculator in ``sps`` mode on ``curve`` whose proposals cost ``draft_s``, with a
    fake clock the test advances by each simulated step's period."""
    from test_compact_verification import K

    speculator = plugin_speculator(dspark_capacity="sps", dspark_sps_curve=curve, **options)
    speculator.controller.set_draft_cost({K: [(1, draft_s * 1e3), (256, draft_s * 1e3)]})
    clock = FakeClock()
    speculator.controller.step_overhead._periods = HostPeriods(clock)
    return speculator, clock


def run_closed_loop(speculator, clock, num_reqs, survival, num_steps, period):
    """``num_steps`` steps of :func:`closed_loop_step`. Returns each step's admission and
    each decision."""
    budgets, decisions, drafted = [], [], True  # the proposal before the first step drafted
    for _ in range(num_steps):
        budget, drafted = closed_loop_step(speculator, clock, num_reqs, survival, period, drafted)
        budgets.append(budget)
        decisions.append(drafted)
    return budgets, decisions


def closed_loop_step(speculator, clock, num_reqs, survival, period, drafted):
    """One step of the real control path: it verifies what sps admits, lasts
    ``period(budget, drafted)`` seconds (``drafted``: whether the proposal it verifies
    drafted) and is followed by the gate's proposal decision, or a rest's
    (capacity/rest.py), as compact_verification's wrapper and the speculator's propose
    take them. Returns (the step's admission, whether the next proposal drafts)."""
    if speculator.controller.resting:  # vLLM's own step, all R K drafts
        budget = num_reqs * speculator.num_speculative_steps
    else:
        budget = speculator.controller.admission_budget(num_reqs)  # 0 after a skipped proposal
        # What the wrapper marks: all R K drafts run vLLM's own step.
        compacted = budget < num_reqs * speculator.num_speculative_steps
        speculator.controller.timed_step = TimedStep(
            num_reqs + budget, num_reqs, compacted=compacted
        )
    clock.now += period(budget, drafted)
    drafted = speculator.controller._rest_proposal(num_reqs)
    resting = drafted is not None
    if not resting:
        speculator.controller._observe_step_time(num_reqs)
        drafted = speculator.controller._plan_drafting(num_reqs, speculator.num_speculative_steps)
    speculator.controller.drafted_last = drafted  # before the record, as in propose
    if drafted and not resting:
        speculator.controller.record_proposal(survival)
    return budget, drafted


def test_sps_learns_the_host_costs_and_admits_what_pays_in_closed_loop(plugin_speculator):
    """A simulated host-bound engine (:func:`host_bound_loop`) at 5 us per verified
    draft: sps must learn O and b and settle on the admission that maximises true tokens
    per second."""
    from test_compact_verification import K

    num_reqs, per_draft_s = 32, 5e-6
    curve = [[1, 8000.0], [64, 6000.0], [256, 2000.0]]
    run = host_bound_loop(plugin_speculator, num_reqs, curve, 12 * WINDOW, per_draft_s)
    speculator, survival, true_rate = run.speculator, run.survival, run.true_rate
    # On the curve alone the gate would have judged drafting too dear from the first step;
    # it waits for the first fit instead, and never closed.
    assert speculator.controller.proposals_skipped == 0 and run.decisions[-1]
    overhead = speculator.controller.step_overhead
    assert overhead.seconds == pytest.approx(2.5e-3, rel=0.05)
    assert overhead.per_draft_seconds == pytest.approx(per_draft_s, rel=0.05)
    best = max(range(num_reqs * K + 1), key=true_rate)
    settled = max(set(run.budgets[-WINDOW:]), key=run.budgets[-WINDOW:].count)
    assert true_rate(settled) >= 0.99 * true_rate(best), (settled, best)
    # Without the overhead model (the curve alone) it would have admitted far less, and
    # its gate would have closed.
    bare = int(sps_best_count(survival, speculator.controller.sps_table))
    assert true_rate(bare) < 0.97 * true_rate(best), (bare, best)
    gate = speculator.controller.draft_gate
    assert not DraftGate(gate.sps_table, gate.draft_seconds).decide(
        num_reqs, survival.mean(dim=0).tolist(), K
    )


def host_bound_loop(plugin_speculator, num_reqs, curve, num_steps, per_draft_s, compaction_s=0.0):
    """The real control path on a simulated host-bound engine (the embedded pair's kind)
    whose step takes, with n drafts verified for R requests, F(R + n) (the curve) + a
    0.3 ms proposal + 2.5 ms + ``per_draft_s`` per draft, and ``compaction_s`` more when
    it verifies fewer than all R K drafts; requests from doubtful to confident (calibrated
    survivals). Returns the speculator, each step's admission and gate decision, the
    survivals and the true tokens per second of an admission."""
    from test_compact_verification import K

    fixed_s, draft_s = 2.5e-3, 3e-4
    speculator, clock = simulated_sps(plugin_speculator, curve, draft_s)
    confidence = torch.linspace(0.3, 0.95, num_reqs)[:, None].repeat(1, K)
    survival = torch.cumprod(confidence, dim=1)
    table = speculator.controller.sps_table_host
    full = num_reqs * K

    def step_seconds(drafts: int) -> float:
        premium = compaction_s if drafts < full else 0.0
        forward = 1 / float(table[num_reqs + drafts])
        return forward + draft_s + fixed_s + per_draft_s * drafts + premium

    def true_rate(drafts: int) -> float:
        ordered = survival.flatten().sort(descending=True).values
        return (num_reqs + float(ordered[:drafts].sum())) / step_seconds(drafts)

    def period(budget: int, drafted: bool) -> float:
        # The step's forward and host work, and the last proposal's drafting.
        return step_seconds(budget) - (0.0 if drafted else draft_s)

    budgets, decisions = run_closed_loop(speculator, clock, num_reqs, survival, num_steps, period)
    return SimpleNamespace(
        speculator=speculator,
        budgets=budgets,
        decisions=decisions,
        survival=survival,
        true_rate=true_rate,
    )


def test_sps_verifies_everything_where_compacting_costs_more_than_it_saves(plugin_speculator):
    """On a flat curve (a tiny target) compacting saves almost no forward time, and on
    the embedded pair it costs host time (input preparation 2.06 against 1.25 ms at 256
    requests, bfbca4e). Blind to that, sps leaves out the unlikeliest drafts and runs
    compacted steps; probing uncompacted steps now and then, it learns C and verifies
    every draft, through vLLM's own step."""
    from test_compact_verification import K

    num_reqs, compaction_s = 32, 1e-3
    flat = [[1, 8000.0], [64, 7900.0], [256, 7500.0]]
    run = host_bound_loop(plugin_speculator, num_reqs, flat, 24 * WINDOW, 1e-6, compaction_s)
    speculator, budgets, true_rate = run.speculator, run.budgets, run.true_rate
    full = num_reqs * K
    # Once the first proposal is read it compacts: the premium is not known yet.
    assert max(budgets[2:WINDOW]) < full
    overhead = speculator.controller.step_overhead
    assert overhead.compaction_seconds == pytest.approx(compaction_s, rel=0.05)
    settled = max(set(budgets[-WINDOW:]), key=budgets[-WINDOW:].count)
    assert settled == full
    assert true_rate(full) > 1.2 * true_rate(budgets[2])
    # Settled on every draft, the controller rests (capacity/rest.py) most steps from
    # then on, and its fit (read through the rests) holds.
    assert speculator.controller.rest.proposals_rested > 0.8 * (len(budgets) - 4 * WINDOW)
    assert budgets[-8 * WINDOW :] == [full] * (8 * WINDOW)


def test_sps_keeps_compacting_where_it_saves_more_than_it_costs(plugin_speculator):
    """A steep curve (a large target under load): compacting saves far more forward time
    than the premium costs, no uncompacted probe is spent there, and sps keeps the
    admission that pays."""
    from test_compact_verification import K

    num_reqs = 32
    steep = [[1, 4000.0], [32, 3000.0], [256, 100.0]]
    run = host_bound_loop(plugin_speculator, num_reqs, steep, 16 * WINDOW, 1e-6, 1e-3)
    budgets, true_rate = run.budgets, run.true_rate
    full = num_reqs * K
    assert full not in budgets[2:]  # (before the first proposal is read, all are verified)
    assert run.speculator.controller.rest.rests == 0
    best = max(range(full + 1), key=true_rate)
    settled = max(set(budgets[-WINDOW:]), key=budgets[-WINDOW:].count)
    assert true_rate(settled) >= 0.99 * true_rate(best), (settled, best)


def test_the_gate_stays_open_where_skipping_costs_more_than_drafting(plugin_speculator):
    """A tiny host-bound engine (the embedded pair at one request): a replayed proposal
    takes 0.3 ms, but a step after a skipped one costs 1.5 ms more than the bare step. On
    O alone the gate closes (drafting's expected tokens look too few for its cost); once
    the skipped steps are measured, skipping is seen to cost more, and it drafts again."""
    from test_compact_verification import K

    num_reqs, fixed_s, draft_s, skip_s = 1, 2.5e-3, 3e-4, 1.5e-3
    curve = [[1, 4000.0], [8, 3900.0], [256, 2000.0]]
    speculator, clock = simulated_sps(plugin_speculator, curve, draft_s)
    # Rarely surviving drafts: with skipping free, one request gains too little from them.
    survival = torch.cumprod(torch.full((num_reqs, K), 0.05), dim=1)
    table = speculator.controller.sps_table_host

    def period(budget: int, drafted: bool) -> float:
        proposal = draft_s if drafted else skip_s
        return 1 / float(table[num_reqs + budget]) + fixed_s + proposal

    _, decisions = run_closed_loop(speculator, clock, num_reqs, survival, 16 * WINDOW, period)
    overhead = speculator.controller.step_overhead
    assert overhead.skip_seconds == pytest.approx(skip_s, rel=0.05)
    assert not all(decisions)  # it did close once, before skipping had been measured
    assert all(decisions[-4 * WINDOW :])  # and drafts for good once it has


def test_plain_steps_are_fitted_apart_and_published_a_window_late():
    # Speculative steps: 2 ms + 20 us per request outside the curve; plain decode steps,
    # in runs of 8 (a probe's burst): 0.5 ms + 4 us per request. Batch sizes and
    # admissions vary between runs.
    rng = np.random.default_rng(2)
    clock = FakeClock()
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    overhead.observe(0, 0.0, 0.0)
    for window in range(6):
        plain_reqs, speculative_reqs = (int(r) for r in rng.integers(1, 257, size=2))
        admitted = int(rng.integers(1, 8 * speculative_reqs))
        for i in range(WINDOW):
            plain = i < 8
            num_reqs = plain_reqs if plain else speculative_reqs
            rest = 0.5e-3 + 4e-6 * num_reqs if plain else 2e-3 + 20e-6 * num_reqs
            clock.now += 1e-3 + 0.4e-3 * (not plain) + rest  # forward (+ drafting)
            drafts = 0 if plain else admitted
            draft_s = 0.0 if plain else 0.4e-3
            overhead.observe(drafts, 1e-3, draft_s, num_reqs, plain=plain)
        if window == 0:
            assert overhead.plain_step_seconds(64) is None  # not before a window's reduction
    assert overhead.plain_step_seconds(64) == pytest.approx(0.5e-3 + 4e-6 * 64, rel=0.01)
    assert overhead.per_step_seconds(64) == pytest.approx(2e-3 + 20e-6 * 64, rel=0.01)


def test_a_plain_step_is_priced_at_most_as_a_speculative_step_verifying_nothing():
    # Speculative steps: 1 ms + 10 us per request outside the curve; plain steps read as
    # 2 ms + 30 us per request (a reading gone wrong: they do less), in runs of 8 whose
    # batch size varies between windows.
    clock = FakeClock()
    overhead = StepOverhead(CPU, periods=HostPeriods(clock))
    overhead.observe(0, 0.0, 0.0)
    for window in range(6):
        for i in range(WINDOW):
            plain = i < 8
            num_reqs = 64 + 32 * window + 8 * (i % 3)
            rest = 2e-3 + 30e-6 * num_reqs if plain else 1e-3 + 10e-6 * num_reqs
            clock.now += 1e-3 + rest
            overhead.observe(0, 1e-3, 0.0, num_reqs, plain=plain)  # no draft verified
    assert overhead.plain_seconds + overhead.plain_per_request_seconds * 256 == pytest.approx(
        2e-3 + 30e-6 * 256, rel=0.05
    )
    bound = overhead.per_step_seconds(256) + overhead.skip_seconds
    assert bound == pytest.approx(1e-3 + 10e-6 * 256, rel=0.05)
    assert overhead.plain_step_seconds(256) == bound


def run_plain_closed_loop(speculator, clock, num_reqs, survival, num_steps, period, plain_s):
    """As :func:`run_closed_loop` with plain steps: the scheduler takes each gate report
    for the steps it schedules from then on, and the running step was scheduled before the
    last report arrived (vLLM's async scheduling). A step scheduled without drafts is a
    plain step of ``plain_s`` seconds. Returns whether each step was plain."""
    num_drafts = speculator.num_speculative_steps
    lookup = this_step = next_step = num_drafts
    plain_steps = []
    for _ in range(num_steps):
        speculator.controller.next_step_drafts = next_step
        if this_step == 0:
            speculator.controller.timed_step = TimedStep(num_reqs, num_reqs, plain=True)
            clock.now += plain_s
        else:
            budget = speculator.controller.admission_budget(num_reqs)
            speculator.controller.timed_step = TimedStep(num_reqs + budget, num_reqs)
            clock.now += period(budget, speculator.controller.drafted_last)
        speculator.controller._observe_step_time(num_reqs)
        drafted = speculator.controller._plan_drafting(num_reqs, num_drafts)
        speculator.controller.drafted_last = drafted
        if drafted:
            speculator.controller.record_proposal(survival)
        report = speculator.controller.take_gate_report()
        lookup = lookup if report is None else report
        plain_steps.append(this_step == 0)
        this_step, next_step = next_step, lookup
    return plain_steps


@pytest.mark.parametrize(
    "num_reqs, confidence, mostly_plain",
    [(8, 0.35, True), (1, 0.9, False)],
    ids=["drain-of-doubtful-requests", "one-confident-request"],
)
def test_plain_steps_run_where_they_are_faster_in_closed_loop(
    plugin_speculator, num_reqs, confidence, mostly_plain
):
    """A host-bound engine (the embedded pair, 13fb6b1): a speculative step spends 2.4 ms
    outside its forward and a skipped proposal 0.2 ms more, a plain step 1.1 ms. For a few
    doubtful requests (a drain's last) plain steps are faster: the gate, once its probe has
    timed them, closes and stays closed. For one confident request drafting is 2x faster:
    plain steps stay rare (the probe's bursts)."""
    from test_compact_verification import K

    fixed_s, draft_s, skip_s, plain_rest_s = 2.4e-3, 2.5e-4, 2e-4, 1.1e-3
    curve = [[1, 2000.0], [64, 2000.0], [256, 1900.0]]
    speculator, clock = simulated_sps(plugin_speculator, curve, draft_s, dspark_plain_steps=True)
    survival = torch.cumprod(torch.full((num_reqs, K), confidence), dim=1)
    table = speculator.controller.sps_table_host

    def period(budget: int, drafted: bool) -> float:
        proposal = draft_s if drafted else skip_s
        return 1 / float(table[num_reqs + budget]) + fixed_s + proposal

    plain_s = 1 / float(table[num_reqs]) + plain_rest_s
    plain = run_plain_closed_loop(
        speculator, clock, num_reqs, survival, 24 * WINDOW, period, plain_s
    )
    overhead = speculator.controller.step_overhead
    assert overhead.plain_step_seconds(num_reqs) == pytest.approx(plain_rest_s, rel=0.05)
    late = plain[-8 * WINDOW :]
    if mostly_plain:
        assert sum(late) >= 0.9 * len(late)
    else:
        assert sum(plain) <= 2 * PLAIN_BURST + 4  # the first burst (and one refresh)
        assert not any(late[: 4 * WINDOW]) or sum(late) <= PLAIN_BURST + 2


def test_a_closed_gate_with_plain_steps_times_its_probes_at_the_new_load(plugin_speculator):
    """The embedded pair at 155bc4a (H100, eight engines on one GPU): a per-draft cost b
    fitted at one request (a few drafts a step, the host's noise) came to 20 us, which
    priced 256 requests' 1,792 drafts at 36 ms. The gate closed at 256 where drafting was
    far faster, and with plain steps each probe drafted once after plain steps, a step the
    fit does not sample: b was never measured again. A probe's burst is timed; b falls to
    what steps at 256 cost and the gate drafts again."""
    from test_compact_verification import K

    fixed_s, draft_s, skip_s, plain_rest_s = 2.4e-3, 2.5e-4, 2e-4, 1.1e-3
    curve = [[1, 2000.0], [256, 1900.0], [2048, 1000.0]]
    speculator, clock = simulated_sps(
        plugin_speculator, curve, draft_s, dspark_plain_steps=True, max_num_seqs=256
    )
    table = speculator.controller.sps_table_host

    def run(num_reqs: int, per_draft_s: float, num_steps: int) -> list[bool]:
        survival = torch.cumprod(torch.full((num_reqs, K), 0.9), dim=1)

        def period(budget: int, drafted: bool) -> float:
            proposal = draft_s if drafted else skip_s
            return 1 / float(table[num_reqs + budget]) + fixed_s + proposal + per_draft_s * budget

        plain_s = 1 / float(table[num_reqs]) + plain_rest_s
        # The batch's prefill first: a step the curve does not describe.
        speculator.controller.timed_step = None
        clock.now += 0.05
        speculator.controller._observe_step_time(num_reqs)
        return run_plain_closed_loop(
            speculator, clock, num_reqs, survival, num_steps, period, plain_s
        )

    # b learnt where drafts are few (here truly 20 us: the fit cannot tell noise from cost).
    run(8, 20e-6, 48 * WINDOW)
    overhead = speculator.controller.step_overhead
    assert overhead.per_draft_seconds == pytest.approx(20e-6, rel=0.2)
    plain = run(256, 0.5e-6, 48 * WINDOW)
    assert sum(plain[: 2 * WINDOW]) > WINDOW  # the gate closed on the dear drafts
    assert overhead.per_draft_seconds < 2e-6
    late = plain[-8 * WINDOW :]
    assert sum(late) <= PLAIN_BURST + 2  # drafting again (a refresh's plain burst at most)


def plan_served_step(controller, num_reqs: int, prompt_tokens: int):
    """plan_step for a served step: ``num_reqs`` requests decoding with all K drafts, and
    new requests' prompts of ``prompt_tokens`` in all. Returns (the plan, the drafts it
    verifies)."""
    from vllm_dspark.capacity.controller import StepFacts

    num_drafts = controller.num_speculative_steps
    facts = StepFacts(
        num_reqs=num_reqs + 4,  # and the new requests' prompts
        num_tokens=num_reqs * (1 + num_drafts) + prompt_tokens,
        num_drafting=num_reqs,
        plain_decode=False,
        next_step_drafts=num_drafts,
        count_decoding=lambda: num_reqs,
    )
    plan = controller.plan_step(facts)
    return plan, num_reqs * num_drafts if plan is None else plan.budget


def test_served_steps_with_prompts_teach_sps_what_each_request_costs(plugin_speculator):
    """A server at saturation (the Qwen3-8B shape under `vllm bench serve`): every step
    also carries prompts, about two prompt tokens per token it emits, as finished requests
    are replaced, and each decoding request's context K/V costs 60 us a step, which the SPS
    curve (dummy requests without context) never sees. Through the real plan_step, such
    steps are samples of the fit: sps learns the per-request cost, charges the prompts to
    nobody's drafts, and settles on the admission with the most tokens per second in the
    long run. The curve alone admits far fewer drafts and loses."""
    from test_compact_verification import K

    num_reqs, prompts_per_token = 64, 2.0
    fixed_s, per_request_s, per_draft_s, draft_s = 1e-3, 60e-6, 2e-6, 1e-3
    # Weight-bound to 64 tokens (4 ms), then 62.5 us per token: at saturation every step
    # is past the knee.
    curve = [[1, 250.0]] + [[tokens, 16000.0 / tokens] for tokens in range(64, 1025, 16)]
    speculator, clock = simulated_sps(plugin_speculator, curve, draft_s)
    controller = speculator.controller
    confidence = torch.linspace(0.6, 0.9, num_reqs)[:, None].repeat(1, K)
    survival = torch.cumprod(confidence, dim=1)
    ordered = survival.flatten().sort(descending=True).values

    def emitted(drafts: int) -> float:
        return num_reqs + float(ordered[:drafts].sum())

    def step_seconds(drafts: int, prompt_tokens: int) -> float:
        forward = controller._forward_seconds(num_reqs + drafts + prompt_tokens)
        return forward + draft_s + fixed_s + per_request_s * num_reqs + per_draft_s * drafts

    def true_rate(drafts: int) -> float:
        """Tokens per second in the long run: each emitted token brings its prompt tokens."""
        tokens = emitted(drafts)
        return tokens / step_seconds(drafts, round(prompts_per_token * tokens))

    budgets, prompt_tokens = [], 0
    for _ in range(10 * WINDOW):
        plan, budget = plan_served_step(controller, num_reqs, prompt_tokens)
        assert controller.timed_step.prompt_tokens == prompt_tokens
        clock.now += step_seconds(budget, prompt_tokens)
        controller._observe_step_time(num_reqs + 4)
        controller.drafted_last = controller._plan_drafting(num_reqs, K)
        controller.record_proposal(survival)
        budgets.append(budget)
        prompt_tokens = round(prompts_per_token * emitted(budget))

    overhead = controller.step_overhead
    assert overhead.per_step_seconds(num_reqs) == pytest.approx(
        fixed_s + per_request_s * num_reqs, rel=0.1
    )
    best = max(range(num_reqs * K + 1), key=true_rate)
    settled = max(set(budgets[-WINDOW:]), key=budgets[-WINDOW:].count)
    assert true_rate(settled) >= 0.99 * true_rate(best), (settled, best)
    bare = int(sps_best_count(survival, controller.sps_table, draft_s))
    assert true_rate(bare) < 0.95 * true_rate(best), (bare, best)


def test_a_step_past_the_curves_table_is_timed_at_its_last_tokens_per_second(
    plugin_speculator,
):
    speculator, _ = simulated_sps(plugin_speculator, [[1, 250.0], [400, 250.0], [800, 125.0]], 0)
    controller = speculator.controller
    last = len(controller.sps_table_host) - 1
    per_token = controller._forward_seconds(last) / last
    assert controller._forward_seconds(3 * last) == pytest.approx(3 * last * per_token)
