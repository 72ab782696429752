"""dspark_plain_steps: while the sps draft gate is closed, vLLM's scheduler schedules
plain decode steps (no drafts), and reopens speculation when the gate does."""

from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.bench.engine_control import switch_speculator
from vllm_dspark.capacity.draft_gate import PLAIN_PROBE_BURST, PROBE_EVERY

K = 3


PLAIN_STEPS = {"dspark_capacity": "sps", "dspark_varlen_verify": True, "dspark_plain_steps": True}


def dflash_acceptance(plugin_speculator, **options):
    """DFlash in capacity=acceptance on a given SPS curve that falls past 16 tokens per
    step, with no step overhead (the costs are known from the first step)."""
    return plugin_speculator(
        K,
        method="dflash",
        dspark_capacity="acceptance",
        dspark_sps_curve=[[1, 100.0], [16, 99.0], [128, 20.0]],
        dspark_step_overhead_ms=0.0,
        **options,
    )


def build_async_scheduler(engine_config, model_dirs, options: dict, num_blocks: int = 64, **kwargs):
    """vLLM's own AsyncScheduler over a KV cache of ``num_blocks`` blocks, for a DSpark
    config with K drafts and the given ``dspark_`` options."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = engine_config(
        {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": K, **options},
        **kwargs,
    )
    block_size = config.cache_config.block_size
    config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    )


@pytest.fixture(params=[{}, PLAIN_STEPS], ids=["stock-config", "plain-steps-config"])
def async_scheduler(request, engine_config, model_dirs):
    """The AsyncScheduler for stock DSpark, or with plain steps (whose Dynamic SD table
    schedules K at every batch size)."""
    return build_async_scheduler(engine_config, model_dirs, request.param, max_model_len=256)


def add_requests(scheduler, count: int, max_tokens: int = 64) -> list[str]:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ids = [f"r{i}" for i in range(count)]
    for req_id in ids:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.add_request(Request(req_id, [5, 6, 7, 8], params, None))
    return ids


def step_output(scheduled, gate: int | None, accepted: list[int] | None = None):
    """What a worker returns for a scheduled step: per request its accepted drafts and one
    token more (no draft accepted by default), and the gate's verdict when it reports one."""
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_dspark.patches.admission_metrics import GATE_ATTR

    req_ids = list(scheduled.num_scheduled_tokens)
    accepted = accepted or [0] * len(req_ids)
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[9] * (1 + n) for n in accepted],
    )
    if gate is not None:
        setattr(output, GATE_ATTR, gate)
    return output


def test_a_closed_gate_makes_the_scheduler_schedule_plain_steps_until_it_reopens(
    async_scheduler,
):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dspark.patches import admission_metrics

    update = admission_metrics._make_update_wrapper(Scheduler.update_from_output)
    scheduler = async_scheduler
    ids = add_requests(scheduler, 4)
    drafts_per_step, gates = [], [None, K, 0, 0, 0, K, K, K]
    for gate in gates:
        scheduled = scheduler.schedule()
        drafts_per_step.append(
            (
                scheduled.num_spec_tokens_to_schedule,
                sorted(len(scheduled.scheduled_spec_decode_tokens.get(r, ())) for r in ids),
            )
        )
        update(scheduler, scheduled, step_output(scheduled, gate))
    # (drafts the step after it gets, drafts each request verifies in it): a prefill, two
    # speculative steps; the 0 reported with step 2 closes the gate from step 3 on, whose
    # own drafts were placed at step 2; plain steps until the K of step 5 reopens it.
    assert drafts_per_step == [
        (K, [0] * 4),
        (K, [K] * 4),
        (K, [K] * 4),
        (0, [K] * 4),
        (0, [0] * 4),
        (0, [0] * 4),
        (K, [0] * 4),
        (K, [K] * 4),
    ]


def gate_speculator(sps_speculator, **options):
    """An sps speculator whose draft gate closes at 16 requests (drafting costs 12 ms,
    survivals of 0.05), as in test_draft_gate.py."""
    speculator = sps_speculator(num_drafts=K, **options)
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 12.0)]})
    for _ in range(2):
        speculator.controller.record_proposal(torch.full((16, K), 0.05))
    return speculator


def test_the_worker_reports_its_gate_and_drafts_only_for_steps_that_verify(sps_speculator):
    import importlib

    from vllm_dspark.patches import compact_verification

    speculator = gate_speculator(sps_speculator, dspark_plain_steps=True)
    assert speculator.controller.take_gate_report() == K  # at start-up: schedule drafts (stock)
    assert speculator.controller.take_gate_report() is None  # once
    speculator.controller.next_step_drafts = K
    assert not speculator.controller._plan_drafting(16, K)  # the gate closes at 16 requests
    assert speculator.controller.take_gate_report() == 0
    # The scheduler has closed too: the gate reopens at one request, but the step this
    # proposal is for was scheduled without drafts, so nothing is drafted for it.
    speculator.controller.next_step_drafts = 0
    assert not speculator.controller._plan_drafting(1, K)
    assert speculator.controller.take_gate_report() == K
    speculator.controller.next_step_drafts = K
    assert speculator.controller._plan_drafting(1, K)
    assert speculator.controller.proposals_skipped == 2
    # A probe of the closed gate: its open verdict holds (though the gate itself closes
    # again) until the scheduler gives a step drafts, so that the probe does draft.
    speculator.controller.next_step_drafts = 0
    verdicts = [speculator.controller._plan_drafting(16, K) for _ in range(PROBE_EVERY + 2)]
    assert not any(verdicts)  # the scheduler gave no step drafts
    assert speculator.controller.take_gate_report() == K  # the probe's open verdict, still pending
    speculator.controller.next_step_drafts = K
    assert speculator.controller._plan_drafting(16, K)  # the probe drafts
    assert not speculator.controller._plan_drafting(16, K)  # and the gate is closed again
    assert speculator.controller.take_gate_report() == 0
    # Switched to sps without plain steps: the scheduler is told to schedule drafts again.
    importlib.import_module(compact_verification.RUNNER_MODULE)
    compact_verification.apply()  # as building a capacity speculator does in a worker
    curve = [[1, 100.0], [16, 99.0], [128, 20.0]]
    switch_speculator(speculator, {"capacity": "sps", "varlen_verify": True, "sps_curve": curve})
    assert speculator.controller.take_gate_report() == K
    speculator.controller.next_step_drafts = 0  # ignored without plain steps
    assert speculator.controller._plan_drafting(1, K)
    assert speculator.controller.take_gate_report() is None


def test_plain_steps_need_sps_or_acceptance_and_no_dynamic_sd_table(engine_config, model_dirs):
    from vllm_dspark.config import DSparkOptionError

    base = {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": K}
    with pytest.raises(DSparkOptionError, match="dspark_plain_steps only applies with"):
        engine_config(
            {
                **base,
                "dspark_capacity": "budget",
                "dspark_varlen_verify": True,
                "dspark_plain_steps": True,
            }
        )
    with pytest.raises(DSparkOptionError, match="num_speculative_tokens_per_batch_size"):
        engine_config(
            {
                **base,
                "dspark_capacity": "sps",
                "dspark_varlen_verify": True,
                "dspark_plain_steps": True,
                "num_speculative_tokens_per_batch_size": [[1, 256, K]],
            }
        )


def test_dflash_acceptance_gates_drafting_on_the_acceptance_it_verified(
    plugin_speculator, monkeypatch
):
    """DFlash has no confidence head: with capacity=acceptance and plain steps, the draft
    gate weighs the acceptance verified per position. At 16 requests, drafts that are never
    accepted close it (the proposal skips drafting, the scheduler is told 0); once closed
    only its probe drafts, and when the probe's drafts are all accepted it reopens."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_dspark import speculator as speculator_module

    speculator = dflash_acceptance(plugin_speculator, dspark_plain_steps=True)
    assert (
        speculator.controller.gates_drafting and speculator.controller.draft_gate is None
    )  # until profiled
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 12.0)]})  # as in gate_speculator
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *a, **kw: "drafted")
    monkeypatch.setattr(speculator_module, "propose_without_drafting", lambda s, c: "skipped")
    speculator.controller.take_gate_report()

    def propose(accepted: int) -> str:
        """A proposal after a step of 16 requests that verified K drafts each."""
        batch = SimpleNamespace(num_reqs=16, cu_num_logits=torch.arange(0, 16 * (K + 1) + 1, K + 1))
        speculator.controller.next_step_drafts = K
        unused = ["last_hidden_states", "aux_hidden_states", "num_rejected", "last_sampled"]
        unused += ["next_prefill_tokens", "temperature", "seeds"]
        return speculator.propose(
            input_batch=batch,
            attn_metadata={},
            slot_mappings={},
            num_sampled=torch.full((16,), accepted + 1),
            **dict.fromkeys(unused),
        )

    assert propose(accepted=0) == "drafted"  # nothing verified yet: optimistic
    assert [propose(accepted=0) for _ in range(3)][-1] == "skipped"
    assert speculator.controller.take_gate_report() == 0 and not speculator.controller.drafted_last
    # Only drafts a proposal computed count: the probes' (a burst of PLAIN_PROBE_BURST per
    # PROBE_EVERY skipped); the first burst's accepted drafts reopen it.
    reopened = [propose(accepted=K) for _ in range(3 * PROBE_EVERY)]
    first = reopened.index("drafted")
    assert first < PROBE_EVERY
    assert reopened[first:] == ["drafted"] * (len(reopened) - first)
    assert speculator.controller.take_gate_report() == K


def test_each_real_step_tells_the_speculator_what_the_next_step_verifies(sps_speculator):
    from vllm_dspark.patches.compact_verification import _make_execute_wrapper

    speculator = gate_speculator(sps_speculator, dspark_plain_steps=True)
    seen = []
    execute = _make_execute_wrapper(
        lambda runner, *a, **kw: seen.append(speculator.controller.next_step_drafts)
    )
    runner = SimpleNamespace(speculator=speculator)
    scheduled = SimpleNamespace(
        num_spec_tokens_to_schedule=0,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[],
    )
    execute(runner, scheduled)
    scheduled.num_spec_tokens_to_schedule = K
    execute(runner, scheduled, dummy_run=True)  # vLLM's warm-up steps leave it alone
    assert seen == [0, 0]
    execute(runner, scheduled)
    assert seen[-1] == K


def test_the_plain_steps_table_schedules_k_at_every_batch_size_and_captures_one_token_graphs(
    engine_config, model_dirs
):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    config = engine_config(
        {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": K}
        | PLAIN_STEPS
    )
    table = config.speculative_config.num_speculative_tokens_per_batch_size
    max_seqs = config.scheduler_config.max_num_seqs
    assert build_dynamic_sd_schedule_lookup(table, max_seqs, K)[1:] == [K] * max_seqs
    # vLLM's CUDA-graph manager captures decode graphs for each count in the table.
    assert sorted({drafts for *_, drafts in table}) == [0, K]


def test_plain_steps_refuse_data_parallelism(engine_config, model_dirs):
    from vllm_dspark.config import DSparkOptionError

    spec = {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": K}
    with pytest.raises(DSparkOptionError, match="data_parallel_size=2"):
        engine_config(spec | PLAIN_STEPS, data_parallel_size=2)


def drafter_graph_candidates(config, num_query_per_req: int):
    """vLLM's own graph listing of a drafter's CUDA-graph manager (DSpark's anchor-first
    layout: K queries per request), without a GPU to build the manager on."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    manager = object.__new__(DFlashCudaGraphManager)
    manager.vllm_config = config
    manager.compilation_config = config.compilation_config
    manager.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16]
    manager.compilation_config.max_cudagraph_capture_size = 16
    manager.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    manager.max_num_reqs = 8
    manager.decode_query_len = num_query_per_req
    manager.lora_capture_cases = [0]
    manager.use_breakable_cg = False
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    return manager._capture_descs


def test_the_drafter_lists_its_graphs_without_the_plain_steps_table(engine_config, model_dirs):
    from vllm_dspark.capacity.plain_steps import without_dynamic_sd_table

    config = engine_config(
        {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": K}
        | PLAIN_STEPS
    )
    # With the table, vLLM derives a query length of 0 for the drafter and fails.
    with pytest.raises(ZeroDivisionError):
        drafter_graph_candidates(config, num_query_per_req=K)
    with without_dynamic_sd_table(config):
        descs = drafter_graph_candidates(config, num_query_per_req=K)
    assert {desc.uniform_token_count for group in descs.values() for desc in group} == {K}
    assert config.speculative_config.num_speculative_tokens_per_batch_size  # put back


def test_the_speculator_builds_its_draft_graph_managers_without_the_table(
    sps_speculator, plugin_speculator, monkeypatch
):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    dflash = plugin_speculator(
        K, method="dflash", dspark_capacity="acceptance", dspark_plain_steps=True
    )
    for speculator, stock in (
        (gate_speculator(sps_speculator, dspark_plain_steps=True), DSparkSpeculator),
        (dflash, DFlashSpeculator),
    ):
        seen = []

        def record(self, cudagraph_mode, seen=seen):
            seen.append(self.vllm_config.speculative_config.num_speculative_tokens_per_batch_size)

        monkeypatch.setattr(stock, "init_cudagraph_manager", record)
        speculator.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
        assert seen == [None]
        assert speculator.vllm_config.speculative_config.num_speculative_tokens_per_batch_size


def test_the_plain_cost_probe_closes_an_open_gate_per_new_batch_range_and_now_and_then():
    from vllm_dspark.capacity.plain_steps import PLAIN_BURST, PLAIN_REFRESH, PlainCostProbe

    probe = PlainCostProbe()
    # 64 requests, never measured: a burst of closed verdicts, then the gate's own.
    assert [probe.closes(64, True) for _ in range(PLAIN_BURST + 4)] == [True] * PLAIN_BURST + [
        False
    ] * 4
    assert not any(probe.closes(100, True) for _ in range(8))  # the same range (64..127)
    # A new range where the gate drafts whatever a plain step costs: no probe, and the range
    # stays unmeasured until the decision is close there.
    assert not probe.closes(128, True, decided=True)
    assert (128).bit_length() not in probe.measured_ranges
    assert probe.closes(128, True)  # a new range, decision open to a plain step's cost
    assert not probe.closes(128, True, decided=True)  # a burst ends once decided
    assert probe.burst_left == 0
    # A closed gate runs plain steps anyway: its range counts as measured.
    assert not probe.closes(16, False)
    assert not probe.closes(16, True)
    # Measured long ago: measured again.
    closed = [probe.closes(16, True) for _ in range(PLAIN_REFRESH)]
    assert closed.index(True) == PLAIN_REFRESH - 2 and sum(closed) == 2
    # Counts and batch sizes only: two probes fed alike decide alike (tensor parallelism).
    other = PlainCostProbe()
    sizes = [
        int(n) for n in torch.randint(1, 257, (3000,), generator=torch.Generator().manual_seed(0))
    ]
    first = PlainCostProbe()
    assert [first.closes(n, n % 3 > 0) for n in sizes] == [
        other.closes(n, n % 3 > 0) for n in sizes
    ]


def closed_measuring_gate(plugin_speculator):
    """An sps speculator with plain steps whose step costs are measured while serving (as
    after its first windows), its draft gate just closed at 16 requests by its own verdict
    (drafting costs 12 ms there, 48 ms at 64; survivals of 0.05)."""
    speculator = plugin_speculator(
        K,
        dspark_capacity="sps",
        dspark_plain_steps=True,
        dspark_sps_curve=[[1, 100.0], [16, 99.0], [128, 20.0]],
    )
    overhead = speculator.controller.step_overhead
    assert overhead.measuring
    overhead.ready = True
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 12.0), (64, 48.0)]})
    for _ in range(2):
        speculator.controller.record_proposal(torch.full((16, K), 0.05))
    speculator.controller.next_step_drafts = K
    assert not speculator.controller._plan_drafting(16, K)
    return speculator


def test_a_closed_gates_plain_steps_count_as_measured_for_the_plain_cost_probe(
    plugin_speculator,
):
    """With its costs measured while serving, an open gate is closed for a burst when the
    batch enters a range whose plain steps were never timed and a plain step's cost could
    close it there; a closed gate's plain steps time that range, so the gate reopened there
    drafts at once."""
    speculator = closed_measuring_gate(plugin_speculator)
    probe = speculator.controller.plain_cost_probe
    assert probe.measured_ranges == {(16).bit_length()}
    verdicts = []
    while not any(verdicts[-1:]):  # survivals all but certain from now on
        speculator.controller.record_proposal(torch.full((16, K), 0.95))
        verdicts.append(speculator.controller._plan_drafting(16, K))
        assert probe.burst_left == 0  # reopened without a burst of its own
    # One request: a new range, but drafting there beats even a plain step costing only
    # the forward (100 tokens/s against 380 for drafting its survivals): no probe.
    assert speculator.controller._plan_drafting(1, K) and probe.burst_left == 0
    assert (1).bit_length() not in probe.measured_ranges


def test_a_gate_closed_as_the_batch_enters_a_new_range_still_probes(plugin_speculator):
    """A gate already closed when the batch size enters a range never timed: its probe (a
    burst of PLAIN_PROBE_BURST proposals in PROBE_EVERY skipped ones) must draft. Reached
    only while the gate was open, the plain-cost probe started its burst on the probe's
    open verdict instead, swallowed it, and, not told of the closed proposals in between,
    kept the rest of its burst for the next probes: 8 x 64 proposals without a draft.
    That fits the H200 arms test at 5e59c9b and 851bbd0 (acceptance-plain: no draft in 129
    proposals of 64 requests, after a warm-up of 4)."""
    speculator = closed_measuring_gate(plugin_speculator)
    drafted = [speculator.controller._plan_drafting(64, K) for _ in range(2 * PROBE_EVERY)]
    first = drafted.index(True)  # one probe's burst in PROBE_EVERY skipped proposals
    assert [i for i, verdict in enumerate(drafted) if verdict] == list(
        range(first, first + PLAIN_PROBE_BURST)
    )


def test_an_acceptance_gate_closed_by_rejections_probes_and_reopens_through_the_scheduler(
    engine_config, model_dirs, plugin_speculator, monkeypatch
):
    """The acceptance gate with plain steps in a closed loop with vLLM's AsyncScheduler,
    ordered as the engine runs them (step t + 1 is scheduled before step t's output is
    taken in). 16 requests whose drafts are all rejected: the gate closes, and the only
    steps that still verify drafts are its probes', a burst per PROBE_EVERY skipped proposals.
    From step 150 every draft is accepted: what a probe verifies reopens the gate, and from
    then on every step verifies drafts."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from vllm_dspark import speculator as speculator_module
    from vllm_dspark.patches import admission_metrics

    options = {
        "dspark_capacity": "acceptance",
        "dspark_plain_steps": True,
        "dspark_sps_curve": [[1, 100.0], [16, 99.0], [128, 20.0]],
        "dspark_step_overhead_ms": 0.0,
    }
    scheduler = build_async_scheduler(
        engine_config,
        model_dirs,
        options | {"dspark_varlen_verify": True},
        num_blocks=512,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    speculator = plugin_speculator(K, **options)
    speculator.controller.set_draft_cost({K: [(1, 0.1), (16, 12.0)]})  # as in gate_speculator
    monkeypatch.setattr(DSparkSpeculator, "propose", lambda self, *a, **kw: None)
    monkeypatch.setattr(speculator_module, "propose_without_drafting", lambda s, c: None)
    update = admission_metrics._make_update_wrapper(Scheduler.update_from_output)
    add_requests(scheduler, 16, max_tokens=600)
    unused = ["last_hidden_states", "aux_hidden_states", "num_rejected", "last_sampled"]
    unused += ["attn_metadata", "slot_mappings", "next_prefill_tokens", "temperature", "seeds"]
    verified_per_step = []
    scheduled = scheduler.schedule()
    for step in range(300):
        req_ids = list(scheduled.num_scheduled_tokens)
        speculator.controller.next_step_drafts = scheduled.num_spec_tokens_to_schedule
        drafts = [len(scheduled.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
        # What compaction verifies: the controller's depth, 0 after a skipped proposal.
        depth = (
            speculator.controller.admission_budget(len(req_ids)) // len(req_ids)
            if any(drafts)
            else 0
        )
        verified = [min(n, depth) for n in drafts]
        accepted = verified if step >= 150 else [0] * len(verified)
        counts = torch.tensor([0] + [1 + n for n in verified]).cumsum(0)
        batch = SimpleNamespace(
            num_reqs=len(req_ids), cu_num_logits=counts, idx_mapping=torch.arange(len(req_ids))
        )
        speculator.propose(
            input_batch=batch,
            num_sampled=torch.tensor([1 + n for n in accepted]),
            **dict.fromkeys(unused),
        )
        output = step_output(scheduled, speculator.controller.take_gate_report(), accepted)
        scheduled_next = scheduler.schedule()
        update(scheduler, scheduled, output)
        scheduled = scheduled_next
        verified_per_step.append(sum(verified))
    closed = verified_per_step[20:150]
    probes = [step for step, n in enumerate(closed) if n]
    bursts = [step for step in probes if step - 1 not in probes]
    assert len(bursts) == 2 and bursts[1] - bursts[0] == PROBE_EVERY + PLAIN_PROBE_BURST - 1
    # The scheduler takes a burst's first verdicts late: two steps in a row verify its
    # drafts.
    assert probes == [bursts[0], bursts[0] + 1, bursts[1], bursts[1] + 1]
    reopened = next(step for step in range(150, 300) if all(verified_per_step[step:]))
    assert reopened < 300 - 20


def test_placeholders_a_proposal_did_not_compute_are_not_counted_as_rejections(
    plugin_speculator,
):
    """A step vLLM verifies uncompacted (here: a prefill joins the batch) verifies every
    position, also those of a proposal the draft gate skipped (all of them) or of one that
    computed 2 positions (the rest). Counted, such placeholders would read as rejections."""
    speculator = dflash_acceptance(plugin_speculator, dspark_dynamic_depth=True)
    # Three decoding requests verifying K positions each, then a prefill.
    batch = SimpleNamespace(num_reqs=4, cu_num_logits=torch.tensor([0, 4, 8, 12, 13]))
    num_sampled = torch.tensor([4, 2, 1, 1])  # accepted K, 1 and 0
    speculator.controller.drafted_last = False
    verified, accepted, counts = speculator.controller.drafted_verification(batch, num_sampled)
    assert verified.tolist() == accepted.tolist() == [0, 0, 0, 0]
    assert counts.tolist() == [0.0] * 2 * K
    speculator.controller.drafted_last, speculator.controller.draft_depth = True, 2
    verified, accepted, counts = speculator.controller.drafted_verification(batch, num_sampled)
    assert verified.tolist() == [2, 2, 2, 0] and accepted.tolist() == [2, 1, 0, 0]
    # Position 1 reached by all three (accepted by 2), position 2 by two (accepted by 1),
    # none beyond the depth.
    assert counts.tolist() == [3, 2, 0, 2, 1, 0]
    # Through the controller: after skipped proposals, the survivals stay what they were.
    speculator.controller.drafted_last = False
    for _ in range(3):
        speculator.controller._observe_real_step(batch, num_sampled)
        speculator.controller._observe_acceptance()
    assert speculator.controller.acceptance.survival().tolist() == [1.0] * K
