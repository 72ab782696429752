"""sps at rest (vllm_dspark/capacity/rest.py): when it starts and ends, and what a resting
step and proposal leave out."""

from types import SimpleNamespace

import torch

from vllm_dspark.capacity.controller import TimedStep
from vllm_dspark.capacity.rest import REST_AFTER, REST_LONGEST, REST_PROPOSALS, AdmissionRest

K = 7


def rested_for(rest: AdmissionRest, num_reqs: int = 16) -> int:
    """Proposals taken until the rest ends (the waking one not counted)."""
    count = 0
    while rest.take_proposal(num_reqs, records_made=100):
        count += 1
    return count


def test_a_rest_starts_after_enough_fresh_readings_and_lasts_its_proposals():
    rest = AdmissionRest()
    for record in range(REST_AFTER - 1):
        rest.observe(True, record, 16)
    rest.observe(False, REST_AFTER, 16)  # one reading that wants fewer drafts: start over
    for record in range(REST_AFTER + 1, 2 * REST_AFTER):
        rest.observe(True, record, 16)
    assert not rest.resting
    rest.observe(True, 2 * REST_AFTER, 16)
    assert rest.resting and rest.rests == 1
    assert rested_for(rest) == REST_PROPOSALS - 1 == rest.proposals_rested
    assert not rest.resting and rest.fresh_from == 100
    # Records made before the waking proposal were counted before the rest.
    for record in range(90, 100):
        rest.observe(True, record, 16)
    assert not rest.resting
    for record in range(100, 100 + REST_AFTER):
        rest.observe(True, record, 16)
    assert rest.resting and rest.rests == 2


def next_rest(rest: AdmissionRest) -> int:
    """Fresh readings wanting every draft until the next rest starts, then its length."""
    for record in range(REST_AFTER):
        rest.observe(True, rest.fresh_from + record, 16)
    return rested_for(rest) + 1  # with the waking proposal


def test_rests_that_follow_each_other_double_up_to_the_longest_and_doubt_or_growth_resets():
    rest = AdmissionRest()
    lengths = [next_rest(rest) for _ in range(6)]
    assert lengths == [128, 256, 512, 1024, 1024, 1024] and REST_LONGEST == 1024
    rest.observe(False, rest.fresh_from, 16)  # one reading that wants fewer drafts
    assert [next_rest(rest) for _ in range(2)] == [REST_PROPOSALS, 2 * REST_PROPOSALS]
    for record in range(REST_AFTER):
        rest.observe(True, rest.fresh_from + record, 16)
    assert rest.take_proposal(16, 100) and not rest.take_proposal(25, 100)  # grown: woken
    assert next_rest(rest) == REST_PROPOSALS


def test_a_batch_that_grows_past_its_bound_wakes_the_rest_and_one_that_shrinks_does_not():
    for num_reqs, woken in ((24, False), (1, False), (25, True)):
        rest = AdmissionRest()
        for record in range(REST_AFTER):
            rest.observe(True, record, 16)
        assert rest.take_proposal(16, 0)
        assert rest.take_proposal(num_reqs, 0) is not woken
        assert rest.resting is not woken


def resting_speculator(sps_speculator, proposals: int):
    """An sps speculator whose rest has ``proposals`` proposals left, at 16 requests."""
    speculator = sps_speculator()
    speculator.controller.rest.left, speculator.controller.rest.batch = proposals, 16
    return speculator


def propose_call(num_reqs: int) -> dict:
    """The speculator's propose arguments for ``num_reqs`` requests in slots 0.., those a
    stubbed draft does not read left None."""
    unused = ["last_hidden_states", "aux_hidden_states", "num_rejected", "last_sampled"]
    unused += ["attn_metadata", "slot_mappings", "next_prefill_tokens", "temperature", "seeds"]
    return dict.fromkeys(unused) | {
        "input_batch": SimpleNamespace(num_reqs=num_reqs, idx_mapping=torch.arange(num_reqs)),
        "num_sampled": torch.ones(num_reqs, dtype=torch.int64),
    }


def test_a_resting_step_runs_vllms_own_step_counted_as_admitting_every_draft(sps_speculator):
    from vllm_dspark.verify.layout import step_facts

    speculator = resting_speculator(sps_speculator, 2)
    speculator.controller.admission_budget = None  # a resting step must not plan
    drafts = {f"r{i}": [-1] * K for i in range(3)}
    step = SimpleNamespace(
        scheduled_spec_decode_tokens=drafts,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_new_reqs=[],
        num_spec_tokens_to_schedule=K,
    )
    facts = step_facts(SimpleNamespace(speculator=speculator), step)
    assert speculator.controller.plan_step(facts) is None
    assert speculator.controller.drafts_proposed == speculator.controller.drafts_admitted == 3 * K
    assert speculator.controller.timed_step is None  # no sample of the step overhead


def test_resting_proposals_draft_without_the_controller_and_the_waking_one_plans(
    sps_speculator, monkeypatch
):
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    monkeypatch.setattr(DSparkSpeculator, "propose", lambda self, *a, **kw: "drafted")
    speculator = resting_speculator(sps_speculator, 3)
    planned = []
    monkeypatch.setattr(
        speculator.controller, "_observe_real_step", lambda *a: planned.append(True)
    )
    call = propose_call(16)

    def propose():
        return speculator.propose(**call)

    assert [propose(), propose()] == ["drafted", "drafted"] and not planned
    assert (
        speculator.controller.proposals_at_depth[K - 1] == 2 and speculator.controller.drafted_last
    )
    # Set by a plain step during the rest: no sample.
    speculator.controller.timed_step = TimedStep(16, 16, plain=True)
    propose()  # wakes: the controller plans again, the step just run is no sample
    assert (
        planned == [True]
        and not speculator.controller.resting
        and speculator.controller.timed_step is None
    )


def test_synthetic_acceptance_reads_every_proposals_survival_resting_or_not(
    sps_speculator, monkeypatch
):
    """A benchmark's synthetic acceptance verifies a request's drafts by the survival they
    were proposed with, also while sps rests (when the controller keeps no copy): a stale
    one would accept the next drafts by another proposal's confidence."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    speculator = resting_speculator(sps_speculator, 3)
    speculator.synthetic = object()  # set with dspark_synthetic_confidence
    speculator.synthetic_slot_survival = torch.ones(16, K)
    drawn = torch.linspace(0.9, 0.1, K).repeat(16, 1)

    def drafted(self, *args, **kwargs):
        self.survival[:16] = drawn  # what the captured draft graph computes
        return "drafted"

    monkeypatch.setattr(DSparkSpeculator, "propose", drafted)
    call = propose_call(16)
    assert speculator.propose(**call) == "drafted" and speculator.controller.resting
    assert torch.equal(speculator.synthetic_slot_survival, drawn)
    assert not torch.equal(speculator.controller.slot_survival[:16], drawn)


def test_ranks_with_different_clocks_admit_rest_and_wake_alike(plugin_speculator):
    """Tensor parallelism: two sps ranks whose host clocks differ (the second's steps read
    1.3x as long), fed the same survivals, their step costs reduced over the ranks, admit,
    rest and wake alike at every step, while the survivals and the batch change."""
    from test_step_overhead import closed_loop_step, simulated_sps

    curve = [[1, 8000.0], [64, 7900.0], [512, 7500.0]]
    ranks = [simulated_sps(plugin_speculator, curve, 3e-4) for _ in range(2)]
    overheads = [speculator.controller.step_overhead for speculator, _ in ranks]

    def reduce_max(tensor):  # the second rank's call completes the collective
        if tensor is overheads[1]._device_value:
            torch.maximum(tensor, overheads[0]._device_value, out=tensor)
            overheads[0]._device_value.copy_(tensor)
            overheads[0]._host_value.copy_(tensor)

    for overhead in overheads:
        overhead._reduce_max = reduce_max
    confident = torch.cumprod(torch.full((64, K), 0.9), dim=1)
    doubtful = torch.cumprod(torch.full((64, K), 0.02), dim=1)
    decisions, drafted = [], [True, True]
    for step in range(900):
        num_reqs = 8 if step < 600 else 16  # grows 2x: wakes a rest
        # Doubtful drafts from within the second rest (256 proposals, ~210-465) to past it.
        survival = (doubtful if 300 <= step < 520 else confident)[:num_reqs]
        per_rank = []
        for rank, (speculator, clock) in enumerate(ranks):
            resting = speculator.controller.resting

            def period(budget, _drafted, slower=1.3**rank):
                return slower * (2.5e-3 + 2e-5 * budget)  # 20 us per verified draft

            budget, drafted[rank] = closed_loop_step(
                speculator, clock, num_reqs, survival, period, drafted[rank]
            )
            per_rank.append((budget, resting))
        assert per_rank[0] == per_rank[1], step
        decisions.append(per_rank[0])
    rests = [speculator.controller.rest for speculator, _ in ranks]
    assert rests[0].proposals_rested == rests[1].proposals_rested > 300
    assert rests[0].rests >= 3  # before the doubtful stretch, after it, after the growth
    # Doubtful: fewer drafts, once the rest that began before the stretch ends.
    assert any(budget < 8 * K for budget, _ in decisions[300:520])
