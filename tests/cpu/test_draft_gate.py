"""The draft gate: skip a proposal when drafting costs more than it gains."""

import pytest
import torch

from vllm_dspark.capacity.draft_gate import (
    HYSTERESIS,
    PLAIN_PROBE_BURST,
    PROBE_EVERY,
    DraftGate,
    SlowestRequest,
    draft_seconds_table,
    proposal_seconds,
)

K, R_MAX = 7, 256


def sps_table(ms_per_token: float, fixed_ms: float) -> torch.Tensor:
    """A target whose step costs fixed_ms + ms_per_token * T."""
    tokens = torch.arange(R_MAX * (1 + K) + 1, dtype=torch.float64)
    return 1000.0 / (fixed_ms + ms_per_token * tokens)


def test_draft_cost_table_interpolates_and_grows_past_the_largest_graph():
    table = draft_seconds_table([(8, 2.0), (1, 1.0), (64, 4.0)], 128)
    assert table[0].item() == pytest.approx(1e-3)  # held below the first point
    assert table[36].item() == pytest.approx(3e-3)  # halfway between 8 and 64
    assert table[128].item() == pytest.approx(8e-3)  # twice the largest graph's batch


def test_the_gate_closes_under_load_and_reopens_as_load_leaves():
    # Weight-bound at small batches (fixed 10 ms), compute-bound at large ones.
    gate = DraftGate(
        sps_table(0.05, 10.0), {K: draft_seconds_table([(1, 1.0), (256, 10.0)], R_MAX)}
    )
    survival = [0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02]
    assert gate.decide(1, survival, K)  # one request: speculation pays
    on, off = gate.gains(1, survival, K)
    assert on > 1.5 * off
    # More than a plain step of the forward alone could: no plain cost would close it.
    assert gate.beats_any_plain_step
    assert not gate.decide(256, survival, K)  # every admission costs more than it gains
    on, off = gate.gains(256, survival, K)
    assert on < off
    assert gate.decide(4, survival, K)  # load left: draft again
    # Drafts that are never accepted are never worth drafting.
    assert not DraftGate(gate.sps_table, gate.draft_seconds).decide(1, [0.0] * K, K)


def test_a_masked_gate_weighs_every_step_at_the_full_forward():
    """Masked verification runs R (1 + K) tokens whether the step verifies one draft per
    request, all K or none (a skipped proposal's placeholders); a plain step runs R."""
    survival = [0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02]
    draft = {K: draft_seconds_table([(1, 1.0), (256, 10.0)], R_MAX)}
    compact = DraftGate(sps_table(0.05, 10.0), draft)
    masked = DraftGate(sps_table(0.05, 10.0), draft, masked_step_drafts=K)
    full_step = 1.0 / float(compact.sps_table[256 * (1 + K)])
    assert masked._forward_seconds(256, 1) == masked._forward_seconds(256, 0) == full_step
    assert compact._forward_seconds(256, 1) < full_step
    # Under load a compacted step verifying nothing beats drafting; masked, it runs the
    # same forward as drafting and saves only the proposal, so drafting pays.
    assert not compact.decide(256, survival, K)
    on, off = masked.gains(256, survival, K)
    assert on > off
    # Against a plain step (R tokens) both weigh the same side without drafting.
    plain = {"plain_s": 0.0}
    assert masked.gains(256, survival, K, **plain)[1] == compact.gains(256, survival, K, **plain)[1]
    assert not masked.decide(256, survival, K, **plain)


def test_a_shallow_proposal_is_weighed_at_its_own_cost():
    survival = [0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02]
    full = draft_seconds_table([(1, 1.0), (256, 10.0)], R_MAX)
    shallow = draft_seconds_table([(1, 0.5), (256, 2.0)], R_MAX)
    gate = DraftGate(sps_table(0.05, 10.0), {1: shallow, K: full})
    assert proposal_seconds(gate.draft_seconds, 256, 1) == pytest.approx(2e-3)
    # Depth 3 has no timed graph: it is weighed at the next deeper one's cost.
    assert proposal_seconds(gate.draft_seconds, 256, 3) == pytest.approx(10e-3)
    # At 256 requests, a full proposal does not pay, a one-position one does: with only
    # the full depth timed the gate closes; with depth 1 timed too it drafts that depth.
    only_full = DraftGate(gate.sps_table, {K: full})
    assert not only_full.decide(256, survival, K) and only_full.depth_chosen == K
    assert gate.decide(256, survival, K) and gate.depth_chosen == 1
    assert gate.decide(256, survival, 1) and gate.depth_chosen == 1
    # At one request the full depth pays: it is kept.
    assert gate.decide(1, survival, K) and gate.depth_chosen == K


def test_hysteresis_keeps_a_decision_near_the_break_even():
    gate = DraftGate(sps_table(0.0, 10.0), {K: torch.zeros(R_MAX + 1, dtype=torch.float64)})
    # With free drafting and a flat target, drafting gains exactly the expected accepted.
    ratio = 1 + HYSTERESIS / 2  # inside the band either way
    survival = [ratio - 1] + [0.0] * (K - 1)
    gate.drafting = True
    assert gate.decide(8, survival, K)
    gate.drafting = False
    assert not gate.decide(8, survival, K)
    assert gate.decide(8, [0.5] + [0.0] * (K - 1), K)  # clearly better: reopens


def test_a_closed_gate_probes_now_and_then_to_measure_survival_again():
    gate = DraftGate(
        sps_table(0.05, 10.0), {K: draft_seconds_table([(1, 1.0), (256, 10.0)], R_MAX)}
    )
    hopeless = [0.0] * K
    decisions = [gate.decide(1, hopeless, K) for _ in range(3 * PROBE_EVERY)]
    probes = [i for i, drafting in enumerate(decisions) if drafting]
    assert probes == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    assert not gate.drafting  # a probe does not reopen the gate by itself
    # A probe that measured good survivals reopens it for good.
    assert gate.decide(1, [0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02], K)
    assert gate.decide(1, [0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02], K)


def test_with_plain_steps_a_probe_drafts_a_burst():
    gate = DraftGate(
        sps_table(0.05, 10.0),
        {K: draft_seconds_table([(1, 1.0), (256, 10.0)], R_MAX)},
        probe_burst=PLAIN_PROBE_BURST,
    )
    decisions = [gate.decide(1, [0.0] * K, K) for _ in range(2 * (PROBE_EVERY + PLAIN_PROBE_BURST))]
    probes = [i for i, drafting in enumerate(decisions) if drafting]
    first = list(range(PROBE_EVERY - 1, PROBE_EVERY - 1 + PLAIN_PROBE_BURST))
    # The next probe counts its skipped proposals from the burst's end.
    second = [i + PROBE_EVERY + PLAIN_PROBE_BURST - 1 for i in first]
    assert probes == first + second
    assert not gate.drafting


def test_the_gate_closes_on_doubtful_drafts_and_the_next_step_verifies_nothing(sps_speculator):
    from types import SimpleNamespace

    from vllm_dspark.metrics import _worker_gate_inputs

    speculator = sps_speculator()
    assert speculator.controller._plan_drafting(16, K)  # no profiled draft cost: always draft
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 12.0)]})  # drafting 16 requests: 12 ms
    assert speculator.controller._plan_drafting(16, K)  # survivals not seen yet: optimistic
    for _ in range(2):  # proposals whose drafts are rarely accepted
        speculator.controller.record_proposal(torch.full((16, K), 0.05))
    assert (
        not speculator.controller._plan_drafting(16, K)
        and speculator.controller.proposals_skipped == 1
    )
    # What the benchmarks report of it: closed, on these survivals and costs.
    worker = SimpleNamespace(model_runner=SimpleNamespace(speculator=speculator))
    assert _worker_gate_inputs(worker) == {
        "gate_open": False,
        "skipped_in_a_row": 1,
        "open_verdict_pending": False,
        "next_step_drafts": None,
        "mean_survival": [0.05] * K,
        "sps_curve": [],  # a given curve, not a profiled one
        "draft_ms": {K: [[1, 0.1], [16, 12.0]]},
    }
    assert speculator.controller._plan_drafting(1, K)  # one request drafts cheaply: worth it again
    speculator.controller.drafted_last = False
    assert speculator.controller.admission_budget(16) == 0


def test_the_slowest_request_is_read_from_its_mean_so_far():
    slowest = SlowestRequest(8, 3, torch.device("cpu"))
    slots = torch.tensor([5, 0, 2], dtype=torch.int32)
    slowest.start(["a", "b", "c"], slots.numpy())
    # Expected accepted drafts 2.7, 1.0, 0.95 (positions not computed count 0).
    first = torch.tensor([[0.9, 0.9, 0.9], [0.6, 0.3, 0.1], [0.95, -1.0, -1.0]])
    assert slowest.reading(slots, first).tolist() == pytest.approx([0.95, 0.0, 0.0])
    slowest.start(["a", "b", "c"], slots.numpy())  # the same requests: nothing restarts
    # Now a drafts worst (0.2), but over their proposals so far b does (1.0 against a's
    # 1.45 and c's 1.675): b is the request the batch waits for.
    second = torch.tensor([[0.2, 0.0, 0.0], [0.6, 0.3, 0.1], [0.9, 0.8, 0.7]])
    assert slowest.reading(slots, second).tolist() == pytest.approx([0.6, 0.3, 0.1])
    # A new request takes b's slot: its mean starts afresh.
    slowest.start(["a", "d", "c"], slots.numpy())
    third = torch.tensor([[0.2, 0.0, 0.0], [0.9, 0.9, 0.9], [0.9, 0.8, 0.7]])
    reading = slowest.reading(slots, third).tolist()
    assert reading == pytest.approx([1.3 / 3, 0.3, 0.3])  # a's mean over its three
    assert slowest.counts[[5, 0, 2]].tolist() == [3, 1, 3]
    assert slowest.sums[0].tolist() == pytest.approx([0.9, 0.9, 0.9])  # d's alone


@pytest.mark.parametrize("objective,drafts", [("step", True), ("batch", False)])
def test_a_batch_objective_weighs_the_request_that_drafts_worst(sps_speculator, objective, drafts):
    speculator = sps_speculator(dspark_gate_objective=objective)
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 2.0)]})
    # 15 requests draft well, one accepts nothing: the mean request gains from drafting,
    # the batch, which lasts as long as that one request, does not.
    survival = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]).repeat(16, 1)
    survival[5] = 0.0
    slots, req_ids = torch.arange(16, dtype=torch.int32), [f"r{i}" for i in range(16)]
    for _ in range(3):
        if speculator.controller.slowest_request is not None:
            speculator.controller.slowest_request.start(req_ids, slots.numpy())
        speculator.controller.record_proposal(survival, slots)
    assert speculator.controller._plan_drafting(16, K) == drafts


def test_with_plain_steps_measured_the_gate_weighs_a_plain_step():
    # A host-bound pair's drain (the embedded pair's last requests, 13fb6b1): 8 requests of
    # low survival; a speculative step spends 2.4 ms outside the curve, a skipped proposal
    # 0.2 ms more, a plain step only 1.1 ms. Against a skipped speculative step, drafting
    # pays; against a plain step it does not.
    gate = DraftGate(sps_table(0.0, 0.5), {K: draft_seconds_table([(1, 0.2), (256, 0.3)], R_MAX)})
    survival = [0.4, 0.15, 0.05, 0.02, 0.01, 0.0, 0.0]
    assert gate.decide(8, survival, K, overhead_s=2.4e-3, skip_s=0.2e-3)
    # Open, but not against every plain step: what one costs decides (the probe measures it).
    assert not gate.beats_any_plain_step
    on, off = gate.gains(8, survival, K, overhead_s=2.4e-3, plain_s=1.1e-3)
    assert off == pytest.approx(8 / 1.6e-3)  # R / (forward + P)
    assert on < off
    assert not gate.decide(8, survival, K, overhead_s=2.4e-3, skip_s=0.2e-3, plain_s=1.1e-3)


def test_the_gate_weighs_survivals_averaged_over_recent_requests():
    from vllm_dspark.capacity.draft_gate import SURVIVAL_MEMORY, SurvivalAverage
    from vllm_dspark.capacity.stale_record import StalePerRequest

    stale, average = StalePerRequest(torch.device("cpu"), [1.0, 1.0]), SurvivalAverage()
    assert average.update(stale, 1) == [1.0, 1.0]  # no record yet: the initial guess
    stale.record(torch.tensor([0.9, 0.6]), 1)
    stale.record(torch.tensor([0.1, 0.0]), 1)
    assert average.update(stale, 1) == pytest.approx([0.9, 0.6])  # the first record read
    assert average.update(stale, 1) == pytest.approx([0.9, 0.6])  # read once
    stale.record(torch.tensor([0.1, 0.0]), 1)
    # One request's doubtful proposal moves the average by 1 / (1 + memory) of the way.
    weight = 1 / (1 + SURVIVAL_MEMORY)
    before = average.update(stale, 1)
    assert before == pytest.approx([0.9 - 0.8 * weight, 0.6 - 0.6 * weight])
    # A batch of 256 requests' mean counts for most of it.
    stale.record(torch.tensor([0.2 * 256, 0.1 * 256]), 256)
    stale.record(torch.tensor([0.0, 0.0]), 256)
    weight = 256 / (256 + SURVIVAL_MEMORY)
    expected = [m + weight * (x - m) for m, x in zip(before, [0.2, 0.1], strict=True)]
    assert average.update(stale, 256) == pytest.approx(expected)


def test_a_short_doubtful_passage_at_one_request_does_not_close_the_gate(plugin_speculator):
    from test_compact_verification import K as NUM_DRAFTS

    # A flat 1 ms forward, 2 ms outside it, 0.5 ms per proposal: at one request drafting
    # pays when the mean survivals sum to more than about 0.2.
    speculator = plugin_speculator(
        dspark_capacity="sps",
        dspark_sps_curve=[[1, 1000.0], [64, 1000.0]],
        dspark_step_overhead_ms=2.0,
    )
    speculator.controller.set_draft_cost({NUM_DRAFTS: [(1, 0.5), (64, 0.5)]})
    confident = torch.cumprod(torch.full((1, NUM_DRAFTS), 0.9), dim=1)
    doubtful = torch.cumprod(torch.full((1, NUM_DRAFTS), 0.02), dim=1)
    decisions = []
    for survival in [confident] * 40 + [doubtful] * 10 + [confident] * 5:
        decisions.append(speculator.controller._plan_drafting(1, NUM_DRAFTS))
        speculator.controller.record_proposal(survival)
    assert all(decisions)
    # On the doubtful proposals' own survivals it would have closed.
    gate = speculator.controller.draft_gate
    doubtful_mean = doubtful[0].tolist()
    assert not DraftGate(gate.sps_table, gate.draft_seconds).decide(
        1, doubtful_mean, NUM_DRAFTS, overhead_s=2e-3
    )


def test_survivals_by_slot_value_the_likely_drafts_the_means_hide():
    """Half the requests draft well and half badly: the mean survivals say drafting costs
    more than it gains at 256 requests, while admitting only the good half's drafts (as
    sps does) pays. Read from a proposal of fewer or more rows, the survivals are taken
    in turn."""
    from vllm_dspark.capacity.allocation import sps_rates

    gate = DraftGate(sps_table(0.05, 10.0), {K: draft_seconds_table([(1, 1.0), (256, 2.0)], R_MAX)})
    good = torch.cumprod(torch.full((K,), 0.95), dim=0)
    bad = torch.cumprod(torch.full((K,), 0.02), dim=0)
    survival = torch.stack([good, bad] * 128)
    mean = survival.mean(dim=0).tolist()
    assert not gate.decide(256, mean, K)
    assert gate.decide(256, mean, K, survival=survival)
    on, off = gate.gains(256, mean, K, survival=survival)
    expected = sps_rates(survival.double(), gate.sps_table, 2e-3).max().item()
    assert on == pytest.approx(expected) and on > 1.1 * off
    # A snapshot of 64 rows stands for 256 requests drafting alike (its rows in turn).
    assert gate.gains(256, mean, K, survival=survival[:64])[0] == pytest.approx(on)
    # The depth drafted bounds the slots: at depth 1 only the first position counts.
    shallow = survival.clone()
    shallow[:, 1:] = -1.0
    at_one = sps_rates(shallow.double(), gate.sps_table, 2e-3).max().item()
    gate.draft_seconds[1] = gate.draft_seconds[K]
    assert gate.gains(256, mean, 1, survival=survival)[0] == pytest.approx(at_one)


def test_a_snapshot_is_valued_once_per_batch_size_and_costs(monkeypatch):
    """The gate decides before every proposal; the snapshot it values by slot and the
    fitted costs change far less often, so each (snapshot, requests, depth, costs) is
    valued once. A new snapshot, batch size or cost is valued anew."""
    from vllm_dspark.capacity import draft_gate

    valued = []
    original = draft_gate.best_rates_by_depth

    def counting(*args):
        valued.append(args[0].shape[0])
        return original(*args)

    monkeypatch.setattr(draft_gate, "best_rates_by_depth", counting)
    gate = DraftGate(sps_table(0.05, 10.0), {K: draft_seconds_table([(1, 1.0), (256, 2.0)], R_MAX)})
    survival = torch.cumprod(torch.rand(64, K, generator=torch.Generator().manual_seed(0)), 1)
    mean = survival.mean(dim=0).tolist()
    first = gate.gains(64, mean, K, survival=survival, overhead_s=2e-3)
    assert gate.gains(64, mean, K, survival=survival, overhead_s=2e-3) == first
    assert valued == [64]
    gate.gains(32, mean, K, survival=survival, overhead_s=2e-3)
    gate.gains(32, mean, K, survival=survival, overhead_s=3e-3)
    gate.gains(32, mean, K, survival=survival.clone(), overhead_s=3e-3)
    assert valued == [64, 32, 32, 32]
