"""benchmarks/step_breakdown.py: the probe's wiring on a fake runner that calls its
methods as vLLM's does, the aggregation of per-step records, and the vLLM 0.26.0
methods and call sites the probe relies on (its GPU run is on the H200)."""

import importlib.util
import inspect
import json
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import step_breakdown as sb  # noqa: E402
from offline_sweep import DEFAULT_RATES  # noqa: E402
from shapes import write_shape  # noqa: E402

# --------------------------------------------------------------------------------------
# A fake runner and speculator with vLLM's call structure, on one fake clock: "GPU"
# events and host stamps both read it, so every phase equals the time advanced in it.


class FakeClock:
    def __init__(self):
        self.t = 0.0  # ms

    def advance(self, ms):
        self.t += ms

    def mark(self):
        return self.t

    def elapsed_ms(self, start, end):
        return end - start

    def synchronize(self):
        pass

    def sleep(self, ms):
        self.t += ms

    def now(self):
        return self.t / 1e3


class FakeOutput:
    def __init__(self, clock):
        self.clock = clock
        self.copy_event = SimpleNamespace(synchronize=lambda: None)

    def get_output(self):
        self.clock.advance(0.1)  # list conversion
        return "output"


class FakeSpeculator:
    """DFlashSpeculator.propose / DSparkSpeculator._generate_draft, reduced to the calls."""

    def __init__(self, clock, k, graph):
        self.clock, self.k, self.graph = clock, k, graph
        self.model = SimpleNamespace(precompute_and_store_context_kv=self._precompute)
        self.query_cudagraph_manager = SimpleNamespace(run_fullgraph=self._replay)
        self.draft_tokens = torch.zeros(8, k, dtype=torch.int64)
        self.block_tables = SimpleNamespace(slot_mappings=torch.zeros(1, 64, dtype=torch.int64))
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=["draft.0"])]
        )

    def _precompute(self, states, positions, slots=None):
        self.clock.advance(0.7)

    def _replay(self, desc):
        self.clock.advance(3.0)
        self.draft_tokens[: desc.num_reqs] = 7

    def propose(self, input_batch, *args, dummy_run=False, mm_inputs=None, **kwargs):
        n = input_batch.num_reqs
        self.clock.advance(0.3)  # hidden-state combine + draft input kernel
        self.model.precompute_and_store_context_kv(None, None, None)
        metadata = self._build_draft_attn_metadata(
            num_reqs=n, num_reqs_padded=n, num_tokens_padded=n * self.k, causal=False
        )
        self.clock.advance(0.2)  # metadata building
        if self.graph:
            desc = SimpleNamespace(
                cg_mode=SimpleNamespace(name="FULL"), num_reqs=n, num_tokens=n * self.k
            )
            self.query_cudagraph_manager.run_fullgraph(desc)
        else:
            self._generate_draft(n, n * self.k, metadata, {}, None)
        self.clock.advance(0.1)
        return self.draft_tokens[:n]

    def _build_draft_attn_metadata(self, num_reqs, num_reqs_padded, num_tokens_padded, **kw):
        return {"draft.0": "metadata"}

    def _generate_draft(self, num_reqs, num_tokens, metadata, slots, across_dp, mode=None):
        hidden = self._run_model(num_tokens, metadata, slots, across_dp, mode)
        self._sample_sequential(num_reqs, hidden)

    def _run_model(self, num_tokens, metadata, slots, across_dp, mode=None):
        self.clock.advance(2.0)
        return torch.zeros(num_tokens, 4)

    def _sample_sequential(self, num_reqs, head_hidden):
        self.clock.advance(1.0)
        self.draft_tokens[:num_reqs] = 99


class FakeRunner:
    """GPUModelRunner.execute_model / sample_tokens, reduced to the calls the probe hooks."""

    def __init__(self, clock, speculator=None, k=0):
        self.clock, self.speculator, self.k = clock, speculator, k
        self.eplb = SimpleNamespace(prepare_forward=lambda config, tokens: None)
        self.batch = None

    def execute_model(self, scheduled, intermediate_tensors=None, dummy_run=False, **kw):
        self.clock.advance(0.5)  # request states
        self.batch = self.prepare_inputs(scheduled, SimpleNamespace(cg_mode=None))
        self.clock.advance(0.5)  # attention metadata
        self.eplb.prepare_forward(None, self.batch.num_tokens)
        self.clock.advance(5.0)  # the forward

    def prepare_inputs(self, scheduled, batch_desc):
        num_reqs, prefill = scheduled
        return SimpleNamespace(
            num_reqs=num_reqs,
            num_tokens=num_reqs * (1 + self.k) + 100 * prefill,
            num_draft_tokens=num_reqs * self.k,
            is_prefilling_np=np.array([i < prefill for i in range(num_reqs)]),
        )

    def sample(self, hidden_states, input_batch, grammar_output):
        self.clock.advance(2.0)

    def sample_tokens(self, grammar_output):
        self.sample(None, self.batch, None)
        self.clock.advance(0.2)  # async output copy + postprocess
        if self.speculator is not None:
            self.speculator.propose(self.batch, {}, {}, None, None, mm_inputs=None)
        self.clock.advance(0.1)
        return FakeOutput(self.clock)


def run_engine(runner, probe, steps, concurrency, prefill_steps=1):
    """vLLM's batch queue of two: step N's output is taken after step N+1 is launched."""
    pending = deque()
    for i in range(steps):
        runner.execute_model((concurrency, concurrency if i < prefill_steps else 0))
        pending.append(runner.sample_tokens(None))
        if len(pending) == 2:
            pending.popleft().get_output()
        runner.clock.advance(0.3)  # scheduler
    return probe.collect()


def make_probe(runner, clock, **shadow):
    probe = sb.StepProbe(runner, clock, now=clock.now, shadow=shadow)
    probe.install()
    return probe


def test_probe_wraps_instances_and_its_phases_add_up_to_the_step():
    clock = FakeClock()
    runner = FakeRunner(clock, FakeSpeculator(clock, k=3, graph=False), k=3)
    probe = make_probe(runner, clock)
    assert "execute_model" in vars(runner)  # an instance attribute...
    assert FakeRunner.execute_model.__name__ == "execute_model"  # ...the class untouched
    runner.execute_model((4, 0))  # not recording yet
    runner.sample_tokens(None)
    probe.start(4)
    runner.execute_model((4, 0), dummy_run=True)  # vLLM's dummy runs are not steps
    data = run_engine(runner, probe, steps=6, concurrency=4)
    assert len(data["records"]) == 6
    row = sb.summarize(data, concurrency=4, k=3)
    # The first step prefills, the last has no following step.
    assert row["steps_used"] == 4
    assert row["steps_excluded"] == {"prefill": 1, "incomplete": 1}
    assert row["phases_ms"] == {
        "host_sched_prep": 1.0,
        "target_forward": 5.0,
        "logits_rejection": 2.0,
        "draft_context_kv": 1.2,
        "draft_backbone": 2.0,
        "markov_lm_head": 1.0,
        "draft_graph": None,
        "host_sync_output": pytest.approx(0.2 + 0.1 + 0.1 + 0.1 + 0.3),
    }
    assert row["step_ms_median"] == pytest.approx(13.0)
    assert row["phases_sum_over_step"] == pytest.approx(1.0)
    assert row["phases_add_up_within_5pct"] is True
    assert row["draft_cudagraph"] == "NONE"
    assert row["within_graph_split"] is None
    # Host timers: the previous step's output is taken between this step and the next.
    assert row["host_ms"]["output_conversion"] == pytest.approx(0.1)
    assert row["host_ms"]["scheduler_and_rest"] == pytest.approx(0.3)
    assert row["host_ms"]["between_steps"] == pytest.approx(0.4)
    assert row["host_ms"]["propose"] == pytest.approx(4.3)


def test_probe_without_speculation():
    clock = FakeClock()
    runner = FakeRunner(clock)
    probe = make_probe(runner, clock)
    assert not any("propose" in hook for hook in probe.hooked)
    probe.start(2)
    row = sb.summarize(run_engine(runner, probe, steps=5, concurrency=2), 2, 0)
    phases = row["phases_ms"]
    assert phases["host_sync_output"] == pytest.approx(0.2 + 0.1 + 0.1 + 0.3)
    assert all(phases[key] is None for key in ("draft_context_kv", "draft_graph"))
    assert row["phases_sum_over_step"] == pytest.approx(1.0)


def test_graph_steps_get_the_split_from_a_shadow_run_and_keep_their_drafts():
    clock = FakeClock()
    spec = FakeSpeculator(clock, k=3, graph=True)
    runner = FakeRunner(clock, spec, k=3)
    probe = make_probe(runner, clock, steps=1, start=2, every=1, repeats=2, sleep_ms=30.0)
    probe.start(4)
    data = run_engine(runner, probe, steps=12, concurrency=4)
    assert [r["id"] for r in data["records"] if r.get("shadow")] == [data["records"][2]["id"]]
    row = sb.summarize(data, 4, 3)
    assert row["steps_excluded"]["shadow_window"] == sb.SHADOW_WINDOW
    assert row["phases_ms"]["draft_graph"] == pytest.approx(3.0)
    assert row["phases_ms"]["draft_backbone"] is None
    split = row["within_graph_split"]
    assert split["samples"] == 2
    assert split["graph_replay_ms"] == pytest.approx(3.0)
    assert split["backbone_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert split["eager_sum_over_graph"] == pytest.approx(1.0)
    assert split["launch_hidden"] is True
    assert row["phases_sum_over_step"] == pytest.approx(1.0)


def test_with_dynamic_depth_the_graph_of_the_depth_drafted_is_timed():
    """The plugin's dynamic depth replays one graph manager per depth, switched between
    steps: each is hooked, so a step drafting at a shallower depth keeps its draft phase."""
    clock = FakeClock()
    spec = FakeSpeculator(clock, k=3, graph=True)

    def shallow_replay(desc):
        clock.advance(1.5)
        spec.draft_tokens[: desc.num_reqs] = 7

    full, shallow = spec.query_cudagraph_manager, SimpleNamespace(run_fullgraph=shallow_replay)
    spec.draft_graph_managers = lambda: {3: full, 1: shallow}
    runner = FakeRunner(clock, spec, k=3)
    probe = make_probe(runner, clock)
    spec.query_cudagraph_manager = shallow  # the speculator drafts at depth 1 from here
    probe.start(4)
    row = sb.summarize(run_engine(runner, probe, steps=6, concurrency=4), 4, 3)
    assert row["draft_cudagraph"] == "FULL"
    assert row["phases_ms"]["draft_graph"] == pytest.approx(1.5)
    assert row["phases_sum_over_step"] == pytest.approx(1.0)


def test_the_shadow_run_puts_the_graphs_drafts_back():
    clock = FakeClock()
    spec = FakeSpeculator(clock, k=3, graph=True)
    runner = FakeRunner(clock, spec, k=3)
    probe = make_probe(runner, clock, steps=1, start=2, every=1, repeats=1)
    probe.start(4)
    data = run_engine(runner, probe, steps=3, concurrency=4)
    assert data["records"][-1].get("shadow")  # the last step, so nothing overwrites after
    # Its eager Markov stage wrote 99s; the graph replay's 7s are what verification reads.
    assert spec.draft_tokens[:4].tolist() == [[7, 7, 7]] * 4


# --------------------------------------------------------------------------------------
# Aggregation on hand-made records.


def record(i, *, reqs=4, prefill=0, tokens=None, host_step=10.0, gpu_step=10.0, **extra):
    """A graph-drafted k=3 step; offsets in ms from its start, host stamps in s."""
    gpu = {
        "fwd_start": 1.0,
        "fwd_end": 5.0,
        "sample_end": 6.0,
        "propose_start": 6.5,
        "ctx_start": 6.7,
        "ctx_end": 7.2,
        "draft_start": 7.5,
        "draft_end": 9.0,
        "propose_end": 9.2,
        "next_start": gpu_step,
    }
    host = {
        "exec_start": i,
        "exec_end": i + 0.001,
        "sample_start": i + 0.002,
        "sample_end": i + 0.004,
        "next_exec_start": i + host_step / 1e3,
    }
    rec = {
        "id": i,
        "num_reqs": reqs,
        "num_prefill": prefill,
        "num_tokens": reqs * 4 if tokens is None else tokens,
        "draft_cudagraph": "FULL",
        "gpu": gpu,
        "host": host,
    }
    return rec | extra


def test_decode_filter_keeps_full_uniform_decode_steps_only():
    records = [
        record(0, prefill=2),
        record(1, reqs=3),
        record(2, tokens=15),
        record(3),
        record(4, shadow=True),
        record(5),
        record(6),
        record(7),
        record(8),
        {"id": 9, "gpu": {}, "host": {}},
    ]
    del records[8]["host"]["next_exec_start"]
    kept, excluded = sb.decode_steps(records, concurrency=4, k=3, window=3)
    assert [r["id"] for r in kept] == [3, 7]
    assert excluded == {
        "prefill": 1,
        "partial_batch": 1,
        "non_uniform": 1,
        "shadow_window": 3,
        "incomplete": 1,
        "no_batch": 1,
    }


def test_compacted_steps_count_with_any_admission_and_skipped_proposals_add_up():
    records = [record(0, tokens=4), record(1, tokens=9), record(2, tokens=17), record(3)]
    kept, excluded = sb.decode_steps(records, concurrency=4, k=3, window=0, compacted=True)
    assert [r["id"] for r in kept] == [0, 1, 3] and excluded == {"non_uniform": 1}
    # The draft gate skipped this proposal: context K/V only, no draft events.
    skipped = record(0, tokens=4)
    del skipped["gpu"]["draft_start"], skipped["gpu"]["draft_end"]
    phases = sb.phase_values(skipped)
    assert "draft_graph" not in phases
    assert sum(phases.values()) == pytest.approx(10.0)
    row = sb.summarize({"records": [skipped], "outputs": [], "shadow": []}, 4, 3, True)
    assert row["verified_tokens_median"] == 4


def test_capacity_arms_run_sps_on_drafts_with_their_own_confidence():
    spec = sb.speculative_config(3, "d", DEFAULT_RATES, acceptance="sps")
    assert spec["dspark_capacity"] == "sps" and spec["dspark_varlen_verify"] is True
    assert spec["dspark_synthetic_confidence"] == pytest.approx([0.8, 0.775, 0.774], abs=1e-3)
    assert "rejection_sample_method" not in spec
    # Their baseline: the same acceptance at fixed k, no capacity control.
    baseline = sb.speculative_config(3, "d", DEFAULT_RATES, acceptance="confidence")
    assert baseline == {
        "method": "dspark",
        "model": "d",
        "num_speculative_tokens": 3,
        "dspark_synthetic_confidence": spec["dspark_synthetic_confidence"],
    }
    rates = sb.speculative_config(3, "d", DEFAULT_RATES)
    assert rates["rejection_sample_method"] == "synthetic"
    assert not any(key.startswith("dspark_") for key in rates)


def test_a_step_missing_an_event_is_incomplete():
    rec = record(0)
    del rec["gpu"]["ctx_end"]
    assert sb.phase_values(rec) is None
    rec = record(0, draft_cudagraph="NONE")  # eager, but no backbone_end event
    assert sb.phase_values(rec) is None


def test_phases_sum_is_compared_with_the_independent_host_step():
    # The GPU partition sums to 10 ms; the host saw 11 ms steps.
    data = {"records": [record(i, host_step=11.0) for i in range(5)], "outputs": [], "shadow": []}
    row = sb.summarize(data, 4, 3)
    assert row["phases_sum_ms"] == pytest.approx(10.0)
    assert row["gpu_step_ms_median"] == pytest.approx(10.0)
    assert row["step_ms_median"] == pytest.approx(11.0)
    assert row["phases_sum_over_step"] == pytest.approx(10 / 11, abs=1e-4)
    assert row["phases_add_up_within_5pct"] is False
    assert row["phases_ms"]["draft_context_kv"] == pytest.approx(1.0)
    assert row["phases_ms"]["host_sync_output"] == pytest.approx(0.5 + 0.2 + 0.8)
    assert row["segments_ms"]["context_kv"] == pytest.approx(0.5)


def test_empty_selection_gives_a_row_without_numbers():
    row = sb.summarize({"records": [record(0, reqs=2)], "outputs": [], "shadow": []}, 4, 3)
    assert row["steps_used"] == 0 and row["step_ms_median"] is None


def test_within_graph_split_is_not_forced_to_the_graph_time():
    samples = [
        {
            "graph_ms": 3.0,
            "backbone_ms": 2.0,
            "markov_ms": 1.5,
            "sleep_graph_ms": 30.0,
            "sleep_eager_ms": 30.0,
            "launch_graph_ms": 0.1,
            "launch_eager_ms": 29.0,
        }
    ]
    split = sb.within_graph_split(samples, graph_in_step_ms=3.1)
    assert split["eager_sum_over_graph"] == pytest.approx(3.5 / 3.0, abs=1e-4)
    assert split["backbone_share"] + split["markov_lm_head_share"] == pytest.approx(1.0)
    assert split["graph_replay_in_step_ms"] == 3.1
    assert split["launch_hidden"] is False  # the eager launches outlasted 90% of the sleep
    assert sb.within_graph_split([], 3.0) is None


def test_merge_rows_replaces_reruns_and_orders_by_arm():
    old = [
        {"arm": "dspark-k7", "concurrency": 1, "v": "old"},
        {"arm": "nospec", "concurrency": 64, "v": "old"},
    ]
    new = [{"arm": "dspark-k7", "concurrency": 1, "v": "new"}]
    merged = sb.merge_rows(old, new)
    assert [(r["arm"], r["v"]) for r in merged] == [("nospec", "old"), ("dspark-k7", "new")]


def test_stack_and_plot(tmp_path):
    rows = [
        {
            "arm": "nospec",
            "concurrency": 1,
            "step_ms_median": 8.0,
            "phases_sum_over_step": 0.99,
            "phases_ms": {"host_sched_prep": 0.5, "target_forward": 6.0, "draft_graph": None},
        },
        {
            "arm": "dspark-k7",
            "concurrency": 1,
            "step_ms_median": 12.0,
            "phases_sum_over_step": 1.01,
            "phases_ms": {"target_forward": 7.0, "draft_graph": 3.0, "host_sync_output": 2.1},
        },
    ]
    assert sb.stack_of(rows[1]) == [
        ("target_forward", 7.0),
        ("draft_graph", 3.0),
        ("host_sync_output", 2.1),
    ]
    pytest.importorskip("matplotlib")
    path = tmp_path / "breakdown.png"
    sb.plot(rows, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_record_carries_the_header(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_COMMIT", "abc123")
    rows = [{"arm": "nospec", "concurrency": 1, "device": "NVIDIA H200", "phases_ms": None}]
    path = tmp_path / "out.json"
    sb.write_record(path, rows, {"shape": "x"})
    record = json.loads(path.read_text())
    assert record["commit"] == "abc123" and record["device"] == "NVIDIA H200"
    assert {"command", "date", "rows", "phases"} <= set(record)


# --------------------------------------------------------------------------------------
# The arms as vLLM builds them, and the vLLM call sites the probe hooks.


def test_speculative_config_truncates_the_rates():
    assert sb.speculative_config(0, "d", DEFAULT_RATES) is None
    spec = sb.speculative_config(3, "d", DEFAULT_RATES)
    assert spec["synthetic_acceptance_rates"] == [0.8, 0.62, 0.48]
    assert spec["num_speculative_tokens"] == 3
    assert spec["rejection_sample_method"] == "synthetic"
    with pytest.raises(ValueError, match="k=3"):
        sb.speculative_config(3, "d", "0.9,0.8")


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_arms_build_v2_engine_configs(engine_config, tmp_path, k):
    draft = write_shape("tiny", tmp_path, draft_layers=1, block=max(k, 1))["draft"]
    assert json.loads((Path(draft) / "config.json").read_text())["block_size"] == max(k, 1)
    config = engine_config(
        sb.speculative_config(k, draft, DEFAULT_RATES), max_model_len=2048, max_num_seqs=256
    )
    # The probe hooks the V2 runner; the no-speculation arm must get it too.
    assert config.use_v2_model_runner
    if k:
        assert config.speculative_config.num_speculative_tokens == k
        assert (
            config.speculative_config.synthetic_acceptance_rates
            == [float(r) for r in DEFAULT_RATES.split(",")][:k]
        )


@pytest.mark.parametrize("arm", ["fp8-k1", "fp8-k3"])
def test_fp8_arms_are_their_dspark_arm_with_the_fp8_head(engine_config, tmp_path, arm):
    k, acceptance, options = sb.ARMS[arm]
    assert sb.ARMS[f"dspark-k{k}"][:2] == (k, acceptance)
    draft = write_shape("tiny", tmp_path, draft_layers=1, block=k)["draft"]
    spec = sb.speculative_config(k, draft, DEFAULT_RATES, acceptance, options)
    assert spec == sb.speculative_config(k, draft, DEFAULT_RATES) | {"dspark_fp8_draft_head": True}
    # The plugin takes its key out and vLLM builds the rest.
    config = engine_config(spec, max_model_len=2048, max_num_seqs=256)
    assert config.speculative_config.num_speculative_tokens == k


@pytest.mark.parametrize("arm,frac", [("all-k7", 1.0), ("compact-k7", 0.99)])
def test_overhead_arms_are_conf_k7_with_a_budget(engine_config, tmp_path, arm, frac):
    """The capacity issue's overhead arms: conf-k7's acceptance, plus budget control
    admitting every draft (a uniform step) or 0.99 of them (a compacted step at 64
    requests: ceil(64 * 7 * 0.99) = 444 of 448)."""
    from vllm_dspark.capacity.allocation import admission_budget
    from vllm_dspark.config import DSparkOptions

    k, acceptance, options = sb.ARMS[arm]
    assert (k, acceptance) == sb.ARMS["conf-k7"][:2]
    draft = write_shape("tiny", tmp_path, draft_layers=1, block=k)["draft"]
    spec = sb.speculative_config(k, draft, DEFAULT_RATES, acceptance, options)
    assert spec == sb.speculative_config(k, draft, DEFAULT_RATES, acceptance) | options
    config = engine_config(spec, max_model_len=2048, max_num_seqs=256)
    resolved = DSparkOptions.from_vllm_config(config)
    assert resolved.capacity == "budget" and resolved.budget_frac == frac
    compacted = admission_budget(64, k, frac) < 64 * k
    assert compacted == (arm == "compact-k7")


@pytest.mark.parametrize("k", [1, 3, 7])
def test_each_sps_arm_has_a_fixed_k_baseline_on_its_acceptance(tmp_path, k):
    """conf-k<k> drafts and accepts as sps-k<k> does, without capacity control: the
    difference between their steps is the controller's."""
    draft = write_shape("tiny", tmp_path, draft_layers=1, block=k)["draft"]
    fixed = sb.speculative_config(k, draft, DEFAULT_RATES, *sb.ARMS[f"conf-k{k}"][1:])
    sps = sb.speculative_config(k, draft, DEFAULT_RATES, *sb.ARMS[f"sps-k{k}"][1:])
    assert sb.ARMS[f"conf-k{k}"][0] == sb.ARMS[f"sps-k{k}"][0] == k
    assert "dspark_synthetic_confidence" in fixed and "dspark_capacity" not in fixed
    assert sps == fixed | {"dspark_capacity": "sps", "dspark_varlen_verify": True}


def test_vllm_checks_k_against_dspark_block_size_only(engine_config, tmp_path):
    """Why the docstring says k < 7 would start with the block-7 draft: vLLM 0.26.0 reads
    ``dspark_block_size``, not the Qwen3 DSpark config's ``block_size``."""
    draft = write_shape("tiny", tmp_path, draft_layers=1, block=7)["draft"]
    config = engine_config(sb.speculative_config(1, draft, DEFAULT_RATES))
    assert config.speculative_config.num_speculative_tokens == 1
    path = Path(draft) / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"dspark_block_size": 7}))
    with pytest.raises(ValueError, match="dspark_block_size"):
        engine_config(sb.speculative_config(3, draft, DEFAULT_RATES))


def _source(function) -> str:
    return inspect.getsource(inspect.unwrap(function))


def _in_order(source: str, *calls: str) -> bool:
    """Each call's last occurrence (the real step's path, after dummy-run branches) comes
    after the previous one's."""
    positions = [source.rfind(call) for call in calls]
    return -1 not in positions and positions == sorted(positions)


def test_vllm_calls_the_hooked_methods_through_the_instances():
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.executor.uniproc_executor import AsyncOutputFuture
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager
    from vllm.v1.worker.gpu.eplb_utils import EPLBController
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    runner_init = _source(GPUModelRunner.__init__)
    assert "self.eplb = EPLBController(" in runner_init
    assert _in_order(
        _source(GPUModelRunner.execute_model),
        "self.prepare_inputs(",
        "self.eplb.prepare_forward(",
        "self.cudagraph_manager.run_fullgraph(",
        "self.model(**model_inputs)",
    )
    assert _in_order(
        _source(GPUModelRunner.sample_tokens),
        "self.sample(",
        "AsyncOutput(",
        "self.speculator.propose(",
    )
    assert _in_order(_source(GPUModelRunner.sample), "compute_logits(", "self.rejection_sampler(")
    assert _in_order(
        _source(DFlashSpeculator.propose),
        "self.model.precompute_and_store_context_kv(",
        "self._build_draft_attn_metadata(",
        "self.query_cudagraph_manager.run_fullgraph(",
        "self._generate_draft(",
    )
    assert "self.query_cudagraph_manager = " in _source(DFlashSpeculator.init_cudagraph_manager)
    assert _in_order(
        _source(DSparkSpeculator._generate_draft), "self._run_model(", "self._sample_sequential("
    )
    assert "self.async_output.get_output()" in _source(AsyncOutputFuture.result)
    assert "self.copy_event.synchronize()" in _source(AsyncOutput.get_output)
    assert "self.draft_tokens = " in _source(DraftModelSpeculator.__init__)
    set_attn = _source(DraftModelSpeculator.set_attn)
    assert "self.block_tables = " in set_attn and "self.kv_cache_config = " in set_attn
    assert callable(Qwen3DSparkForCausalLM.precompute_and_store_context_kv)
    assert callable(EPLBController.prepare_forward)
    assert list(inspect.signature(CudaGraphManager.run_fullgraph).parameters) == ["self", "desc"]
    assert list(inspect.signature(DFlashSpeculator._run_model).parameters) == [
        "self",
        "num_tokens",
        "attn_metadata",
        "slot_mappings",
        "num_tokens_across_dp",
        "cudagraph_runtime_mode",
    ]
    assert list(inspect.signature(DSparkSpeculator._sample_sequential).parameters) == [
        "self",
        "num_reqs",
        "head_hidden",
    ]
    fields = set(InputBatch.__dataclass_fields__)
    assert {"num_reqs", "num_tokens", "num_draft_tokens", "is_prefilling_np"} <= fields
    assert {"cg_mode", "num_reqs", "num_tokens"} <= set(
        BatchExecutionDescriptor.__dataclass_fields__
    )


def test_the_worker_routes_steps_through_the_runner_instance():
    from vllm.v1.worker.gpu_worker import Worker

    assert "self.model_runner.execute_model(" in _source(Worker.execute_model)
    assert "self.model_runner.sample_tokens(" in _source(Worker.sample_tokens)


def test_main_runs_one_process_per_arm_with_a_block_k_draft_and_merges(tmp_path, monkeypatch):
    specs = []

    def fake_run(command, **kwargs):
        spec = json.loads(command[command.index("--arm-spec") + 1])
        specs.append(spec)
        row = {
            "concurrency": spec["concurrency"][0],
            "k": spec["k"],
            "device": "NVIDIA H200",
            "step_ms_median": 10.0,
            "phases_sum_over_step": 1.0,
            "steps_used": 5,
            "phases_ms": {"target_forward": 9.0, "host_sync_output": 1.0},
        }
        return SimpleNamespace(returncode=0, stdout="noise\nROW " + json.dumps(row), stderr="")

    monkeypatch.setattr(sb.subprocess, "run", fake_run)
    first = tmp_path / "first.json"
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", "--arms", "nospec", "--out", str(first)])
    assert sb.main() == 0
    out = tmp_path / "out.json"
    argv = ["step_breakdown.py", "--arms", "dspark-k1,dspark-k3", "--concurrency", "64"]
    monkeypatch.setattr(sys, "argv", [*argv, "--merge", str(first), "--out", str(out)])
    assert sb.main() == 0
    assert [s["k"] for s in specs] == [0, 1, 3]
    assert specs[0]["draft"] is None
    for spec in specs[1:]:
        config = json.loads((Path(spec["draft"]) / "config.json").read_text())
        assert config["block_size"] == spec["k"]
    record = json.loads(out.read_text())
    assert [(r["arm"], r["concurrency"]) for r in record["rows"]] == [
        ("nospec", 1),
        ("dspark-k1", 64),
        ("dspark-k3", 64),
    ]
    assert record["earlier_commands"] == [f"step_breakdown.py --arms nospec --out {first}"]
    assert record["device"] == "NVIDIA H200"


def test_host_profile_reports_time_per_execute_model_call(tmp_path):
    def busy(n: int) -> int:
        total, i = 0, 0
        while i < n:
            total += i * i
            i += 1
        return total

    # A function defined in a file of a vllm_dspark folder: the plugin's own table.
    plugin_file = tmp_path / "vllm_dspark" / "controller.py"
    plugin_file.parent.mkdir()
    plugin_file.write_text("def admit(busy):\n    return busy(5_000)\n")
    spec = importlib.util.spec_from_file_location("fake_controller", plugin_file)
    controller = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(controller)

    def execute_model() -> None:
        busy(20_000)
        controller.admit(busy)

    worker = SimpleNamespace()
    sb.start_host_profile(worker)
    for _ in range(4):
        execute_model()
    report = sb.stop_host_profile(worker, top=5)
    assert report["steps"] == 4
    assert report["by_own_time"][0]["function"].endswith(":busy")
    cumulative = {row["function"].rsplit(":", 1)[1]: row for row in report["by_cumulative_time"]}
    assert cumulative["busy"]["calls_per_step"] == 2.0  # from execute_model and admit
    # Nearly all of a step is busy's own time, counted once per step.
    step_us = cumulative["execute_model"]["cumulative_us_per_step"]
    busy_us = report["by_own_time"][0]["own_us_per_step"]
    assert 0.9 * step_us <= busy_us <= step_us
    plugin = report["plugin_by_cumulative_time"]
    assert [row["function"] for row in plugin] == ["controller.py:1:admit"]
    # admit's cumulative time holds the busy work it calls, beyond its own one line.
    admit = plugin[0]
    assert 10 * admit["own_us_per_step"] <= admit["cumulative_us_per_step"] < busy_us


def test_the_embedded_pair_runs_its_own_acceptance_and_confidence():
    sps = sb.speculative_config(7, "pair/draft", DEFAULT_RATES, acceptance="sps", real=True)
    assert sps == {
        "method": "dspark",
        "model": "pair/draft",
        "num_speculative_tokens": 7,
        "dspark_capacity": "sps",
        "dspark_varlen_verify": True,
    }
    fixed = sb.speculative_config(7, "pair/draft", DEFAULT_RATES, real=True)
    assert fixed == {"method": "dspark", "model": "pair/draft", "num_speculative_tokens": 7}


def test_the_embedded_pair_refuses_arms_its_drafter_was_not_trained_for(monkeypatch, capsys):
    arguments = ["--pair", "embedded", "--arms", "nospec,dspark-k3", "--out", "unused.json"]
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", *arguments])
    with pytest.raises(SystemExit):
        sb.main()
    assert "k=7 arms only; not ['dspark-k3']" in capsys.readouterr().err


def test_the_batch_time_splits_prefill_steady_state_and_tail():
    records = [
        record(0, prefill=4, host_step=30.0),
        record(1, host_step=12.0),
        record(2, host_step=10.0, shadow=True),
        record(3, host_step=50.0),
        record(4, host_step=10.0),
        record(5, reqs=3, host_step=8.0),
        record(6, reqs=1, host_step=6.0),
        record(7, reqs=1),
        {"id": 8, "gpu": {}, "host": {}},
    ]
    del records[7]["host"]["next_exec_start"]  # the batch's last step: nothing after it
    split = sb.batch_time(records, concurrency=4, window=2)
    kinds = {
        "decode": (2, 22.0, 20.0, 11.0, 4.0),
        "prefill": (1, 30.0, 10.0, 30.0, 4.0),
        "shadow_window": (2, 60.0, 20.0, 30.0, 4.0),
        "tail": (2, 14.0, 20.0, 7.0, 2.0),
    }
    fields = ("steps", "ms", "gpu_ms", "ms_median", "requests_per_step")
    assert split == {kind: dict(zip(fields, v, strict=True)) for kind, v in kinds.items()}
    row = sb.summarize({"records": records, "outputs": [], "shadow": []}, 4, 3)
    assert row["batch_ms"] == sb.batch_time(records, concurrency=4)  # its shadow window


def test_prefill_steps_lists_each_prefill_step_and_the_one_after():
    records = [
        {"id": 0, "gpu": {}, "host": {}},  # execute_model returned before its batch
        record(1, prefill=4, tokens=300, host_step=40.0, gpu_step=38.0),
        record(2, prefill=2, tokens=150, host_step=90.0),
        record(3, host_step=12.0),
        record(4, host_step=11.0),
    ]
    steps = sb.prefill_steps(records)
    assert [(s["prefilling"], s["tokens"], s["ms"]) for s in steps] == [
        (4, 300, 40.0),
        (2, 150, 90.0),
        (0, 16, 12.0),
    ]
    assert steps[0]["gpu_ms"] == 38.0
    assert steps[0]["segments_ms"]["target_forward"] == 4.0
    assert sb.prefill_steps(records[3:]) == []  # no prefill recorded
    assert len(sb.prefill_steps(records[:3])) == 2  # the batch ends on its last prefill


def test_the_closed_breakdown_arm_keeps_the_draft_gate_closed(plugin_speculator):
    """step_breakdown's closed-k3 options: plain steps throughout, but for a probe every
    PROBE_EVERY proposals (its first step: the gate decides from the start)."""
    from test_compact_verification import K
    from test_step_overhead import FakeClock, run_plain_closed_loop

    from vllm_dspark.capacity.draft_gate import PROBE_EVERY

    speculator = plugin_speculator(dspark_capacity="sps", **sb.ARMS["closed-k3"][2])
    speculator.controller.set_draft_cost({K: [(1, 0.5), (256, 3.0)]})
    num_reqs, num_steps = 100, 4 * PROBE_EVERY
    survival = torch.cumprod(torch.full((num_reqs, K), 0.9), dim=1)
    plain = run_plain_closed_loop(
        speculator, FakeClock(), num_reqs, survival, num_steps, lambda *_: 0.03, 0.01
    )
    assert sum(not p for p in plain) <= num_steps // PROBE_EVERY * 3 + 3
