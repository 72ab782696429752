"""What the DeepSeek-V4 GPU stages run, checked without a GPU: offline_sweep on a DSV4
shape (engine arguments, speculative configs, masked arms, rows' ``verify`` and
``greedy_identical``), --greedy-check's switch to verification by the target, the probe's
spec for a drafter held in the target's checkpoint, and gpu_stage.sh's dsv4 stages (run
with a stand-in python3)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import offline_sweep  # noqa: E402

from vllm_dspark.config import DSparkOptions  # noqa: E402

DSV4_ARMS = "nospec,dspark,sps-masked,acceptance-masked"
STAGE_ARMS = "nospec,sps-masked,sps,dspark"  # gpu_stage.sh's dsv4 stage


class FakeEngine:
    """subprocess.Popen of an offline_sweep engine: prints ``lines`` as the engine would."""

    def __init__(self, lines: list[str]):
        self.stdout = ["a log line\n", *(line + "\n" for line in lines)]
        self.returncode = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_engines(monkeypatch) -> types.SimpleNamespace:
    """From now on every engine offline_sweep.main() starts prints ``.lines(spec)``;
    ``.specs`` lists their specs."""
    state = types.SimpleNamespace(specs=[], lines=lambda spec: [])

    def start(command, **kwargs):
        state.specs.append(json.loads(command[command.index("--arm-spec") + 1]))
        return FakeEngine(state.lines(state.specs[-1]))

    monkeypatch.setattr(offline_sweep.subprocess, "Popen", start)
    return state


@pytest.fixture
def fake_popen(monkeypatch):
    return fake_engines(monkeypatch)


def row_line(row: dict) -> str:
    return "ROW " + json.dumps(row)


def greedy_line(row: int, token_ids: list[list[int]]) -> str:
    return "GREEDY " + json.dumps({"row": row, "token_ids": token_ids})


def sweep(monkeypatch, tmp_path, *args: str) -> list[dict]:
    """offline_sweep.main() on ``args``; the last record it wrote."""
    written = []
    monkeypatch.setattr(
        offline_sweep, "write_record", lambda path, rows, failed: written.append(rows)
    )
    argv = ["offline_sweep.py", *args, "--out", str(tmp_path / "o.json")]
    monkeypatch.setattr(sys, "argv", argv)
    assert offline_sweep.main() == 0
    return written[-1] if written else []


def test_a_dsv4_sweep_serves_the_shape_as_vllm_does_and_marks_each_row(
    fake_popen, monkeypatch, tmp_path
):
    """The DeepSeek-V4 sweep: one folder (the target, its DSpark module inside), an FP8 KV
    cache in blocks of 256, no "model" in the speculative config, the masked arms in one
    engine started masked; each row says how its arm verifies and, from --greedy-check,
    whether its outputs were no speculation's."""
    reference = [[5, 6, 7], [8, 9, 10]]
    diverged = [[5, 6, 7], [8, 9, 11]]  # the second request differs from position 2

    def lines(spec):
        names = [name for name, _ in spec["switch"]] if spec["switch"] else [None]
        printed = [
            row_line({"concurrency": c, "tok_s": 1.0} | ({"arm": n} if n else {}))
            for n in names
            for c in spec["concurrency"]
        ]
        for index, (name, c) in enumerate((n, c) for n in names for c in spec["concurrency"]):
            if name != "acceptance-masked":  # an arm whose check never came: no verdict
                outputs = diverged if (name, c) == ("sps-masked", 16) else reference
                printed.append(greedy_line(index, outputs))
        return printed

    fake_popen.lines = lines
    args = ["--pair", "dsv4-flash-reduced", "--acceptance", "confidence", "--arms", DSV4_ARMS]
    rows = sweep(
        monkeypatch, tmp_path, *args, "--shared-engine", "--greedy-check", "--concurrency", "1,16"
    )
    nospec, dspark, shared = fake_popen.specs
    for spec in (nospec, dspark, shared):
        assert spec["engine"] == {"kv_cache_dtype": "fp8", "block_size": 256}
        assert spec["draft"] is None and spec["dflash"] is None and spec["greedy_check"]
    config = json.loads((Path(nospec["target"]) / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["n_routed_experts"] == 64
    assert offline_sweep.speculative_config(nospec) is None
    stock = offline_sweep.speculative_config(dspark)
    assert "model" not in stock and stock["method"] == "dspark"
    assert stock["num_speculative_tokens"] == 7 and len(stock["dspark_synthetic_confidence"]) == 7
    masked = offline_sweep.speculative_config(shared)
    assert "model" not in masked
    assert masked["dspark_varlen_verify"] is False and "dspark_dynamic_depth" not in masked
    assert all(updates["varlen_verify"] is False for _, updates in shared["switch"])
    assert [name for name, _ in shared["switch"]] == DSV4_ARMS.split(",")[2:]

    table = {(row["arm"], row["concurrency"]): row for row in rows}
    assert len(table) == 8 and {row["shape"] for row in rows} == {"dsv4-flash-reduced"}
    assert {arm: row["verify"] for (arm, _), row in table.items()} == {
        "nospec": "none",
        "dspark": "none",
        "sps-masked": "masked",
        "acceptance-masked": "masked",
    }
    assert table["dspark", 16]["greedy_identical"] is True
    assert table["sps-masked", 1]["greedy_identical"] is True
    differing = table["sps-masked", 16]
    assert differing["greedy_identical"] is False
    assert differing["greedy_identical_requests"] == 1
    assert differing["greedy_divergences"] == [[1, 2]]
    assert table["acceptance-masked", 1]["greedy_identical"] is None


def test_a_dsv4_sweep_refuses_dflash_arms_and_takes_compact_ones(fake_popen, monkeypatch, tmp_path):
    for arms in ("dspark,dflash", "dflash"):
        argv = ["offline_sweep.py", "--pair", "tiny-dsv4", "--arms", arms]
        monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path / "o.json")])
        with pytest.raises(SystemExit):
            offline_sweep.main()
    assert fake_popen.specs == []
    # The masked arms alone, the compact ones (DeepSeek-V4 compacts on SM90), and the
    # Qwen3 shapes' compact arms unchanged.
    assert sweep(monkeypatch, tmp_path, "--pair", "tiny-dsv4", "--arms", "sps-masked") == []
    assert sweep(monkeypatch, tmp_path, "--pair", "tiny-dsv4", "--arms", "nospec,sps,budget") == []
    assert [spec["options"] for spec in fake_popen.specs[1:]] == [
        None,
        offline_sweep.ARMS["sps"],
        offline_sweep.ARMS["budget"],
    ]
    start, _ = offline_sweep.shared_engine_plan(["sps", "sps-masked"], None)
    assert start["dspark_varlen_verify"] and start["dspark_dynamic_depth"]


def test_every_capacity_mode_has_a_masked_arm_that_one_engine_switches_to(
    fake_popen, monkeypatch, tmp_path
):
    """#56 asks DeepSeek-V4's reduced shape for greedy outputs under every capacity mode
    verified masked: one engine takes them all, each row verifying masked."""
    masked = ["sps-masked", "budget-masked", "threshold-masked", "acceptance-masked"]
    modes = typing.get_args(DSparkOptions.model_fields["capacity"].annotation)
    assert {offline_sweep.ARMS[arm]["dspark_capacity"] for arm in masked} == set(modes) - {"off"}
    fake_popen.lines = lambda spec: [
        row_line({"concurrency": 16, "tok_s": 1.0} | ({"arm": name} if name else {}))
        for name, _ in spec["switch"] or [(None, None)]
    ]
    arms = ",".join(["nospec", *masked])
    rows = sweep(monkeypatch, tmp_path, "--pair", "tiny-dsv4", "--arms", arms, "--shared-engine")
    assert len(fake_popen.specs) == 2  # no speculation's engine and one shared engine
    assert [name for name, _ in fake_popen.specs[-1]["switch"]] == masked
    assert all(options["varlen_verify"] is False for _, options in fake_popen.specs[-1]["switch"])
    assert {row["arm"]: row["verify"] for row in rows if row["arm"] != "nospec"} == dict.fromkeys(
        masked, "masked"
    )


def test_a_dsv4_shared_engine_with_compact_arms_starts_compact_without_depth_graphs(
    fake_popen, monkeypatch, tmp_path
):
    """The dsv4 stage's arms: masked and compact sps in one engine, started compact (as
    the GPU losslessness test starts its compact arms) and without depth graphs, which no
    arm drafts by; each row says how its arm verifies."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    from test_dsv4_lossless_gpu import COMPACT_START

    def lines(spec):
        names = [name for name, _ in spec["switch"]] if spec["switch"] else [None]
        return [
            row_line({"concurrency": 1, "tok_s": 1.0} | ({"arm": n} if n else {})) for n in names
        ]

    fake_popen.lines = lines
    rows = sweep(
        monkeypatch, tmp_path, "--pair", "tiny-dsv4", "--arms", STAGE_ARMS, "--shared-engine"
    )
    shared = fake_popen.specs[1]  # the capacity engine starts second, as its first arm stands
    assert (
        shared["options"]
        == COMPACT_START
        == {
            "dspark_capacity": "sps",
            "dspark_varlen_verify": True,
        }
    )
    assert shared["switch"] == [
        ["sps-masked", {"capacity": "sps", "varlen_verify": False}],
        ["sps", {"capacity": "sps", "varlen_verify": True}],
    ]
    assert {row["arm"]: row["verify"] for row in rows} == {
        "nospec": "none",
        "dspark": "none",
        "sps-masked": "masked",
        "sps": "compact",
    }
    # A depth arm among them still gets its depth graphs.
    start, _ = offline_sweep.shared_engine_plan(["sps", "sps-depth"], None, deepseek_v4=True)
    assert start["dspark_dynamic_depth"]


@pytest.mark.parametrize("arms,compact", [(DSV4_ARMS, False), (STAGE_ARMS, True)])
def test_a_dsv4_engine_builds_the_config_vllm_serves(
    vllm_cpu, monkeypatch, tmp_path, arms, compact
):
    """The engine process's LLM() arguments for a shared engine (of the masked arms, or of
    the dsv4 stage's, started compact) make a config vLLM 0.26.0 and the plugin accept: an
    FP8 KV cache in blocks of 256, the drafter from the target's folder, sps with
    synthetic confidence, verified as the engine starts; every arm switched to, the
    sweep's and the GPU losslessness test's that start so, is valid options beside it,
    verified masked or compacted as it says."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dspark
    from vllm_dspark.config import DSparkOptions

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    from test_dsv4_lossless_gpu import COMPACT_SWITCH, MASKED_SWITCH

    vllm_dspark.register()
    for name in [n for n in os.environ if n.startswith("VLLM_DSPARK_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the engine sets it
    folder = offline_sweep.write_deepseek_v4_shape("tiny-dsv4", tmp_path)
    capacity_arms = [arm for arm in arms.split(",") if arm not in ("nospec", "dspark")]
    start, switch = offline_sweep.shared_engine_plan(capacity_arms, None, deepseek_v4=True)
    spec = {
        "target": folder,
        "draft": None,
        "dflash": None,
        "dummy": True,
        "acceptance": "confidence",
        "options": start,
        "rates": offline_sweep.DEFAULT_RATES,
        "num_drafts": 7,
        "engine": offline_sweep.DSV4_ENGINE,
    }
    started = []

    class Started(Exception):
        pass

    def record(**kwargs):
        started.append(kwargs)
        raise Started

    monkeypatch.setattr(vllm, "LLM", record)
    with pytest.raises(Started):
        offline_sweep.Engine(spec)
    (kwargs,) = started
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["block_size"] == 256
    assert kwargs["dtype"] == "bfloat16" and kwargs["load_format"] == "dummy"
    config = EngineArgs(**kwargs).create_engine_config()
    assert (config.cache_config.cache_dtype, config.cache_config.block_size) == ("fp8", 256)
    assert config.speculative_config.model == folder
    assert config.speculative_config.draft_model_config.architectures == ["DSparkDraftModel"]
    options = DSparkOptions.from_vllm_config(config)
    assert options.capacity == "sps" and options.varlen_verify is compact
    assert options.synthetic_confidence is not None and not options.dynamic_depth
    kept = options.non_default()
    for arm, updates in switch + (COMPACT_SWITCH if compact else MASKED_SWITCH):
        switched = DSparkOptions.model_validate(kept | updates)
        verify = offline_sweep.verification({"dspark_" + k: v for k, v in updates.items()})
        assert switched.varlen_verify is (verify == "compact"), arm
        assert switched.capacity != "off", arm
        assert switched.synthetic_confidence == options.synthetic_confidence


class FakeOutputProcessor:
    def process_outputs(self, outputs, *args, **kwargs):
        return None


class FakeLLM:
    """vllm.LLM for one engine process: every request gets ``output`` (its prompt's first
    token, then 0s) at once; ``calls`` records each generate's prompts and each
    collective_rpc's function name, in order."""

    calls: list = []

    def __init__(self, **kwargs):
        self.llm_engine = types.SimpleNamespace(output_processor=FakeOutputProcessor())

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(["generate", [p["prompt_token_ids"][0] for p in prompts]])
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        return [
            types.SimpleNamespace(
                outputs=[
                    types.SimpleNamespace(
                        token_ids=[prompt["prompt_token_ids"][0]] + [0] * (p.max_tokens - 1)
                    )
                ]
            )
            for prompt, p in zip(prompts, per_prompt, strict=True)
        ]

    def get_metrics(self):
        return []

    def collective_rpc(self, method, args=()):
        self.calls.append([method.__name__, *args])
        if method.__name__ == "_worker_trace":
            return [None]
        return [True] if method.__name__ == "_worker_accept_by_target" else [{}]


@pytest.fixture
def engine_process(monkeypatch, capsys):
    """run_arm_here with FakeLLM at concurrencies 1 and 2, --greedy-check on; ``run(**spec)``
    returns the lines it printed and the calls it made."""
    import vllm

    FakeLLM.calls = []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    # A speculating engine sets it for its calls into the workers: restored afterwards.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    spec = {
        "target": "t",
        "draft": None,
        "dflash": None,
        "dummy": True,
        "rates": offline_sweep.DEFAULT_RATES,
        "num_drafts": 7,
        "prompt_len": 4,
        "output_len": 3,
        "concurrency": [1, 2],
        "repeats": 1,
        "min_requests": 1,
        "prompts": "arithmetic",
        "switch": None,
        "greedy_check": True,
    }

    def run(**overrides):
        FakeLLM.calls.clear()
        offline_sweep.run_arm_here(spec | overrides)
        printed = capsys.readouterr().out.splitlines()
        lines = [line for line in printed if line.startswith(("ROW ", "GREEDY "))]
        return lines, list(FakeLLM.calls)

    return run


def test_the_greedy_check_follows_the_rows_verified_by_the_target(engine_process):
    """After every row, each concurrency's first wave once more, with synthetic acceptance
    switched off around it (only then); the outputs go to the driver by row."""
    lines, calls = engine_process(options={}, acceptance="confidence")
    assert [line.split(" ", 1)[0] for line in lines] == ["ROW", "ROW", "GREEDY", "GREEDY"]
    checks = [json.loads(line.removeprefix("GREEDY ")) for line in lines[2:]]
    assert [check["row"] for check in checks] == [0, 1]
    # The first wave's prompts of each concurrency (offset c: repeat 0, wave 0).
    firsts = [
        [p["prompt_token_ids"][0] for p in offline_sweep.sweep_prompts(c, c, 4)] for c in (1, 2)
    ]
    assert [[ids[0] for ids in check["token_ids"]] for check in checks] == firsts
    toggles = [i for i, call in enumerate(calls) if call[0] == "_worker_accept_by_target"]
    assert [calls[i][1] for i in toggles] == [True, False, True, False]
    assert toggles[0] > max(i for i, call in enumerate(calls) if call[0] == "_worker_trace")
    for on, first in zip(toggles[::2], firsts, strict=True):
        assert calls[on + 1] == ["generate", first] and calls[on + 2][1] is False


def test_the_greedy_check_switches_nothing_without_synthetic_confidence(engine_process):
    lines, calls = engine_process(options=None, acceptance="confidence")
    assert [line.split(" ", 1)[0] for line in lines] == ["ROW", "ROW", "GREEDY", "GREEDY"]
    assert not any(call[0] == "_worker_accept_by_target" for call in calls)
    # vLLM's synthetic rates cannot be switched off in a running engine: no check.
    lines, calls = engine_process(options={}, acceptance="rates")
    assert [line.split(" ", 1)[0] for line in lines] == ["ROW", "ROW"]
    assert not any(call[0] == "_worker_accept_by_target" for call in calls)


def test_compare_greedy_waits_for_no_speculation_and_finds_first_differences():
    rows = [{"arm": "sps-masked", "concurrency": 1}, {"arm": "nospec", "concurrency": 1}]
    checks = {0: [[1, 2, 3], [4, 5]]}
    offline_sweep.compare_greedy(rows, checks)
    assert "greedy_identical" not in rows[0]  # no reference yet
    checks[1] = [[1, 2, 4], [4, 5]]
    offline_sweep.compare_greedy(rows, checks)
    assert rows[0]["greedy_identical"] is False and rows[0]["greedy_divergences"] == [[0, 2]]
    assert rows[1]["greedy_identical"] is True and rows[1]["greedy_identical_requests"] == 2


def test_accept_by_target_switches_synthetic_acceptance_off_and_back(monkeypatch):
    from vllm_dspark.bench import synthetic_acceptance
    from vllm_dspark.patches.wrapping import ORIGINAL_ATTR

    sampler = importlib.import_module(synthetic_acceptance.SAMPLER_MODULE)
    stock = getattr(sampler.rejection_sample, ORIGINAL_ATTR, sampler.rejection_sample)
    monkeypatch.setattr(sampler, "rejection_sample", stock)  # restored after the test
    monkeypatch.setattr(synthetic_acceptance, "_speculator", None)

    class Speculator:  # weakly referenced by the plugin
        synthetic = object()

    speculator = Speculator()
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(speculator=speculator))
    synthetic_acceptance.apply(speculator)  # as the plugin does at start-up
    assert getattr(sampler.rejection_sample, ORIGINAL_ATTR) is stock
    assert offline_sweep._worker_accept_by_target(worker, True)
    assert sampler.rejection_sample is stock
    assert offline_sweep._worker_accept_by_target(worker, False)
    assert getattr(sampler.rejection_sample, ORIGINAL_ATTR) is stock
    # A speculator without synthetic confidence: nothing to switch, and the driver refuses.
    plain = types.SimpleNamespace(model_runner=types.SimpleNamespace(speculator=object()))
    assert not offline_sweep._worker_accept_by_target(plain, True)
    llm = types.SimpleNamespace(collective_rpc=lambda fn, args: [fn(w, *args) for w in (plain,)])
    with pytest.raises(RuntimeError, match="no synthetic"):
        offline_sweep.accept_by_target(llm, True)


def load_llm_probe():
    path = ROOT / "tests" / "gpu" / "llm_probe.py"
    spec = importlib.util.spec_from_file_location("llm_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_dummy_asks_the_probe_for_a_drafter_held_in_the_target(monkeypatch):
    import pair_probe

    llm_probe = load_llm_probe()
    sent = []
    monkeypatch.setattr(pair_probe, "run_probe", lambda script, stdin: sent.append(stdin))
    engine = {"kv_cache_dtype": "fp8", "block_size": 256}
    pair_probe.run_dummy("dsv4", None, {"dspark_capacity": "sps"}, dtype="bfloat16", engine=engine)
    pair_probe.run_dummy("target", "draft", {})  # as the Qwen3 dummy pairs' tests call it
    pair_probe.run_dummy("target", "draft", None)
    dsv4, pair, nospec = map(json.loads, sent)
    assert dsv4["dtype"] == "bfloat16" and dsv4["engine"] == engine and dsv4["dummy"]
    assert llm_probe.speculative_config(dsv4) == {
        "method": "dspark",
        "num_speculative_tokens": 7,
        "dspark_capacity": "sps",
    }
    assert pair["dtype"] == nospec["dtype"] == "float32"
    assert llm_probe.speculative_config(pair)["model"] == "draft"
    assert llm_probe.speculative_config(nospec) is None


FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in python3: logs each call (a -c check as "check") with the routing and graph
# variables
if [ "$1" = -c ]; then echo "check" >> "$CALLS"; exit "${FAKE_CHECK_RC:-0}"; fi
graphs="${VLLM_USE_BREAKABLE_CUDAGRAPH:-}|${DSV4_CUDAGRAPH_MODE:-}"
echo "$*|${VLLM_MOE_ROUTING_SIMULATION_STRATEGY:-}|$graphs" >> "$CALLS"
[ "$1" = -m ] && exit "${FAKE_PYTEST_RC:-0}"
exit 0
"""


@pytest.fixture
def stage(tmp_path):
    """gpu_stage.sh in a copied tree whose bundle scripts do nothing and whose python3
    logs its calls; ``stage(*args, **env)`` returns (exit code, stderr, calls)."""
    tree = tmp_path / "tree"
    (tree / "tools" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device" / "gpu_stage.sh", tree / "tools" / "device")
    for name in ("bundle.sh", "register_plugin.sh", "moe_bundle.sh", "no_multicast.env"):
        (tree / "tools" / "device" / name).write_text("true\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    calls = tmp_path / "calls"

    def run(*args, **env):
        calls.write_text("")
        done = subprocess.run(
            ["bash", "tools/device/gpu_stage.sh", *args],
            cwd=tree,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "CALLS": str(calls)} | env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.returncode, done.stderr, calls.read_text().splitlines()

    return run


def test_the_dsv4_lossless_stage_exits_with_pytests_status(stage):
    returncode, _, calls = stage("dsv4-lossless", "abc", FAKE_PYTEST_RC="3")
    assert returncode == 3
    assert calls[0] == "check"
    assert calls[1].startswith("-m pytest tests/gpu/test_dsv4_lossless_gpu.py ")
    assert calls[1].endswith("|||")  # the model's own routers, vLLM's own graphs
    returncode, stderr, calls = stage("dsv4-lossless", "abc", FAKE_CHECK_RC="1")
    assert returncode == 1 and calls == ["check"] and "dsv4 set" in stderr


def test_dsv4_stages_take_a_graph_mode_or_breakable_graphs_from_the_start(stage):
    _, _, calls = stage("dsv4-lossless", "abc", "FULL_DECODE_ONLY")
    assert calls[1].endswith("||FULL_DECODE_ONLY")
    _, _, calls = stage("dsv4-lossless", "abc", "breakable")
    assert calls[1].endswith("|1|")
    _, _, calls = stage("dsv4", "abc", "nospec", "1", "FULL_DECODE_ONLY")
    args = calls[1].split("|")[0].split()
    assert args[args.index("--cudagraph-mode") + 1] == "FULL_DECODE_ONLY"
    _, _, calls = stage("dsv4", "abc", "nospec", "1", "breakable")
    assert "--cudagraph-mode" not in calls[1] and calls[1].split("|")[2] == "1"


def test_sweep_stages_interleave_a_shared_engines_arms_only_when_asked(stage):
    for args, position in ((("dsv4", "abc"), 7), (("moe-qwen3", "abc"), 5)):
        _, _, calls = stage(*args)
        assert "--interleave" not in calls[-1]
        padded = [*args, *[""] * (position - 1 - len(args))]
        _, _, calls = stage(*padded, "interleave")
        assert "--interleave" in calls[-1].split("|")[0].split()
        returncode, stderr, _ = stage(*padded, "mirror")
        assert returncode == 2 and "interleave" in stderr


def test_the_dsv4_stage_sweeps_the_reduced_shape_with_simulated_routing(
    stage, monkeypatch, tmp_path
):
    """Its command is one offline_sweep accepts for the shape (run here on fake engines):
    no speculation, stock DSpark, and sps verified masked and compacted in one shared
    engine, with vLLM's uniform random routing; the third and fourth arguments replace
    the arms and concurrencies."""
    returncode, _, calls = stage("dsv4", "abc")
    assert returncode == 0 and calls[0] == "check"
    command, routing, breakable, graph_mode = calls[1].split("|")
    assert routing == "uniform_random" and not (breakable or graph_mode)
    script, *args = command.split()
    assert script == "benchmarks/offline_sweep.py"
    out = args.index("--out")
    assert args[out + 1].endswith("/deepseek_v4.json")
    assert {"--greedy-check", "--shared-engine"} <= set(args)
    del args[out : out + 2]
    _, _, calls = stage("dsv4", "abc", "nospec,sps-masked", "1,16")
    named = calls[1].split("|")[0].split()
    assert named[named.index("--arms") + 1] == "nospec,sps-masked"
    assert named[named.index("--concurrency") + 1] == "1,16"
    engines = fake_engines(monkeypatch)  # after the stage's own processes
    sweep(monkeypatch, tmp_path, *args)
    assert engines.specs[0]["target"].endswith("dsv4-flash-reduced")
    nospec, shared, stock = engines.specs  # #59's ratios come from the first two engines
    assert nospec["options"] is None and stock["options"] == {}
    assert nospec["concurrency"] == [1, 16, 64, 256]
    assert shared["options"] == {"dspark_capacity": "sps", "dspark_varlen_verify": True}
    assert [name for name, _ in shared["switch"]] == ["sps-masked", "sps"]


def test_segment_sync_names_the_breakable_graph_segment_that_faults(monkeypatch):
    """llm_probe's segment sync (the dsv4-probe stage's): a replay that faults names its
    segment, a captured graph or the eager op of a layer, as vLLM records them."""
    import torch
    from vllm.compilation import breakable_cudagraph as breakable

    llm_probe = load_llm_probe()
    recorded = []
    capture = types.SimpleNamespace(_capturing=True, add_eager=recorded.append)
    monkeypatch.setattr(breakable, "is_breakable_cudagraph_enabled", lambda: True)
    monkeypatch.setattr(breakable.BreakableCUDAGraphCapture, "current", lambda: capture)
    monkeypatch.setattr(breakable, "is_forward_context_available", lambda: False)

    class Attention:
        prefix = "model.layers.3.attn"

        @breakable.eager_break_during_capture
        def attention_impl(self, hidden):
            return hidden

    Attention().attention_impl(2)  # captured: vLLM records the eager break
    graph = types.SimpleNamespace()
    graph.replay = types.MethodType(lambda self: None, graph)  # as CUDAGraph.replay, bound
    segments = [graph.replay, recorded[0], graph.replay]
    assert llm_probe.segment_name(graph.replay) == "a captured graph"
    assert llm_probe.segment_name(recorded[0]) == (
        "the eager Attention.attention_impl of model.layers.3.attn"
    )
    synced = []

    def synchronize():
        synced.append(True)
        if len(synced) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(breakable.BreakableCUDAGraphCapture, "replay", None)
    llm_probe.install_segment_sync()
    replay = breakable.BreakableCUDAGraphCapture.replay
    with pytest.raises(RuntimeError, match="segment 1 of 3, the eager Attention.attention_impl"):
        replay(types.SimpleNamespace(segments=segments))


def test_eager_draft_keeps_the_drafter_from_capturing_graphs(monkeypatch):
    """llm_probe's eager draft (a dsv4-probe engine): the drafter's graph manager is built
    for no CUDA graphs whatever mode the runner asks for."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    asked = []
    monkeypatch.setattr(
        DFlashSpeculator, "init_cudagraph_manager", lambda self, mode: asked.append(mode)
    )
    load_llm_probe().install_eager_draft()
    DFlashSpeculator.init_cudagraph_manager(object(), CUDAGraphMode.FULL_AND_PIECEWISE)
    assert asked == [CUDAGraphMode.NONE]
