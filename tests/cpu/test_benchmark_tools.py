"""The benchmark scripts' own logic (their GPU runs are on the H200)."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))


def test_offline_sweep_arms_build_engine_configs(engine_config, model_dirs, tmp_path):
    """Every arm of the capacity sweep is a config vLLM and the plugin accept, with the
    calibrated synthetic acceptance of the dummy-weight setup."""
    import offline_sweep

    rates = [float(r) for r in offline_sweep.DEFAULT_RATES.split(",")]
    conditional = offline_sweep.conditional_rates(rates)
    assert conditional[0] == rates[0]
    assert conditional[3] == rates[3] / rates[2]
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"curve": [[1, 100.0], [64, 90.0], [512, 30.0]]}))
    for arm, options in offline_sweep.ARMS.items():
        if options is None:
            continue
        if arm.startswith("sps"):
            options = options | {"dspark_sps_curve": str(curve)}
        if "dspark_fp8_draft_head" in options:
            continue  # checked against the GPU when the draft loads
        options = dict(options)
        if "dspark_draft_vocab" in options:
            options["dspark_draft_vocab"] = 1024  # within the tiny drafters' 4096 tokens
        if options.pop("method", "dspark") == "dflash":
            # No confidence head: vLLM's synthetic rates.
            base = {"method": "dflash", "model": model_dirs["dflash"]}
            base |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
        else:
            base = {"method": "dspark", "model": model_dirs["dspark_no_confidence"]}
            base["dspark_synthetic_confidence"] = conditional
        config = engine_config({**base, "num_speculative_tokens": 7, **options})
        assert config.speculative_config.num_speculative_tokens == 7, arm
        assert config.speculative_config.method == base["method"], arm


def test_capacity_arms_share_an_engine_only_with_the_same_start_up_options():
    """A shared engine switches capacity options; an FP8 head, a draft vocabulary or FP8
    drafter layers are built at start-up, so only arms that agree on them share one."""
    from offline_sweep import ARMS, LEAN_DRAFTING, engine_runs, startup_options

    assert startup_options("dflash-depth-plain-lean") == {"method": "dflash"} | LEAN_DRAFTING
    assert startup_options("sps-depth-plain") == {}
    arms = ["nospec", "dflash", "dflash-depth-plain-lean", "dflash-depth-plain"]
    arms += ["dflash-lean", "dflash-depth-lean", "dflash-acceptance", "sps", "sps-plain"]
    runs = engine_runs(arms, shared_engine=True, sps_curve=None)
    labels = [label for label, _, _ in runs]
    assert labels == [
        "nospec",
        "dflash",
        "dflash-depth-plain-lean+dflash-depth-lean",
        "dflash-depth-plain+dflash-acceptance",
        "dflash-lean",  # fixed depth: no capacity options to switch
        "sps+sps-plain",
    ]
    _, start, switches = runs[2]
    assert start["method"] == "dflash" and start["dspark_capacity"] == "acceptance"
    assert start.items() >= LEAN_DRAFTING.items() and start["dspark_plain_steps"]
    for arm, updates in switches:  # only what a running engine can switch
        assert "fp8_draft_backbone" not in updates and "draft_vocab" not in updates
        assert updates["dynamic_depth"] and updates.get("plain_steps", False) == (
            arm == "dflash-depth-plain-lean"
        )
    # Without --shared-engine, and for a capacity arm alone, each arm runs as itself.
    assert all(switch is None for _, _, switch in engine_runs(arms, False, None))
    ((label, options, switch),) = engine_runs(["sps-depth-plain-lean"], True, None)
    assert (label, options, switch) == (
        "sps-depth-plain-lean",
        ARMS["sps-depth-plain-lean"],
        None,
    )


def test_graphs_to_extends_vllms_capture_sizes_past_512():
    from offline_sweep import capture_sizes, engine_kwargs

    sizes = capture_sizes(1024)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-4:] == [512, 640, 768, 1024]
    assert sizes == sorted(set(sizes))
    assert "compilation_config" not in engine_kwargs("m")
    assert engine_kwargs("m", graphs_to=2048)["compilation_config"] == {
        "cudagraph_capture_sizes": capture_sizes(2048)
    }
    # 256 requests of a K=7 DSpark drafter (7 query tokens each) have a draft graph; the
    # target's 8 tokens each fit 2,048.
    assert {256 * 7, 256 * 8} <= set(capture_sizes(2048))
    # A graph mode joins the sizes (DeepSeek-V4 with FULL decode graphs only).
    assert engine_kwargs("m", graphs_to=2048, cudagraph_mode="FULL_DECODE_ONLY")[
        "compilation_config"
    ] == {"cudagraph_capture_sizes": capture_sizes(2048), "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert engine_kwargs("m", cudagraph_mode="FULL_DECODE_ONLY")["compilation_config"] == {
        "cudagraph_mode": "FULL_DECODE_ONLY"
    }


def test_sweep_engines_cache_no_prefix():
    """Arms switched in one engine run the same prompts one after another: none may find
    them cached (the first arm would pay every prefill the later ones skip)."""
    from offline_sweep import engine_kwargs

    assert engine_kwargs("m")["enable_prefix_caching"] is False
    assert engine_kwargs("m", dummy=False, graphs_to=1024)["enable_prefix_caching"] is False


def test_dummy_weight_engines_name_the_extension_that_finishes_them():
    """A dummy DeepSeek-V4 target needs its first layer's hyper-connection sum, which
    vLLM's dummy loader skips; checkpoints load as vLLM does."""
    from offline_sweep import engine_kwargs
    from vllm.engine.arg_utils import EngineArgs

    dummy = engine_kwargs("m")["worker_extension_cls"]
    assert dummy == "vllm_dspark.bench.dummy_weights.DummyWeightsExtension"
    assert (
        engine_kwargs("m", dummy=False)["worker_extension_cls"] == EngineArgs.worker_extension_cls
    )


@pytest.fixture
def fake_llm(monkeypatch):
    """``vllm.LLM`` replaced by an engine that generates zeros at once and records each
    batch's prompts (``batches``); a test may patch in a subclass of it."""
    import types

    import vllm

    class FakeOutputProcessor:
        def process_outputs(self, outputs, *args, **kwargs):
            return None

    class FakeLLM:
        batches: list[list[list[int]]] = []
        params: list = []  # each batch's sampling parameters: one, or one per prompt

        def __init__(self, **kwargs):
            self.llm_engine = types.SimpleNamespace(output_processor=FakeOutputProcessor())

        def generate(self, prompts, params, use_tqdm=False):
            self.batches.append([p["prompt_token_ids"] for p in prompts])
            self.params.append(params)
            per_prompt = params if isinstance(params, list) else [params] * len(prompts)
            # One engine step: every request gets all its tokens and finishes.
            self.llm_engine.output_processor.process_outputs(
                [
                    types.SimpleNamespace(
                        request_id=str(i), new_token_ids=[0] * p.max_tokens, finished=True
                    )
                    for i, p in enumerate(per_prompt)
                ]
            )
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * p.max_tokens)])
                for p in per_prompt
            ]

        def get_metrics(self):
            return []

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return FakeLLM


def test_offline_sweep_reports_the_median_of_fresh_repeats(fake_llm, monkeypatch, capsys):
    import offline_sweep

    seen_prompts = fake_llm.batches
    clock = iter(range(100))
    monkeypatch.setattr(offline_sweep.time, "perf_counter", lambda: next(clock) ** 2 / 10)
    spec = {
        "options": None,
        "target": "t",
        "dummy": True,
        "prompt_len": 32,
        "output_len": 20,
        "concurrency": [2],
        "repeats": 3,
        "min_requests": 1,
        "prompts": "arithmetic",
        "switch": None,
    }
    offline_sweep.run_arm_here(spec)
    row = json.loads(capsys.readouterr().out.split("ROW ", 1)[1])
    # Runs of 0.1, 0.5 and 0.9 s (the fake clock) for 40 tokens each: the median counts.
    assert row["tok_s_repeats"] == [400.0, 80.0, 44.4]
    assert row["tok_s"] == 80.0
    # Warm-ups (the engine's, its settling pass, the concurrency's: the same prompts as
    # the settling pass), then three fresh prompt sets, then the first of them again,
    # untimed, step by step (its seeds too: the same synthetic draws).
    assert len(seen_prompts) == 7 and seen_prompts[1] == seen_prompts[2]
    assert seen_prompts[6] == seen_prompts[3]
    assert [p.seed for p in fake_llm.params[6]] == [p.seed for p in fake_llm.params[3]]
    first_blocks = [tuple(prompt[:16]) for batch in seen_prompts[2:6] for prompt in batch]
    first_blocks += [tuple(prompt[:16]) for prompt in seen_prompts[0]]
    assert len(set(first_blocks)) == len(first_blocks)  # nothing a prefix cache could reuse
    # Each measured prompt greedy with a seed of its own, which another arm's run of the
    # same prompts repeats (the synthetic acceptance's common random numbers).
    measured = fake_llm.params[3:6]
    seeds = [[p.seed for p in batch] for batch in measured]
    assert all(p.temperature == 0.0 for batch in measured for p in batch)
    assert len({seed for batch in seeds for seed in batch}) == 3 * 2
    fake_llm.params.clear()
    offline_sweep.run_arm_here(spec)
    assert [[p.seed for p in batch] for batch in fake_llm.params[3:6]] == seeds


def test_a_batch_timeline_shows_its_prefill_phase_and_its_tail(monkeypatch):
    import types

    import offline_sweep

    def out(request, tokens, finished=False):
        return types.SimpleNamespace(
            request_id=request, new_token_ids=[0] * tokens, finished=finished
        )

    class Processor:
        def process_outputs(self, outputs):
            return len(outputs)

    # Four requests: two prefilled in the first step, two in the second; the first two
    # finish at the third step, the others at the fifth (a straggler's tail).
    engine_steps = [
        [out("a", 1), out("b", 1)],
        [out("a", 3), out("b", 2), out("c", 1), out("d", 1)],
        [out("a", 2, True), out("b", 3, True), out("c", 2), out("d", 3)],
        [out("c", 3), out("d", 2, True)],
        [out("c", 1, True)],
        [],  # statistics only: no step
    ]
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(output_processor=Processor()))
    clock = iter([10.0, 10.01, 10.02, 10.03, 10.05, 10.08])
    monkeypatch.setattr(offline_sweep.time, "perf_counter", lambda: next(clock))
    with offline_sweep.step_timeline(llm) as steps:
        assert [llm.llm_engine.output_processor.process_outputs(o) for o in engine_steps] == [
            2,
            4,
            4,
            2,
            1,
            0,
        ]
    assert "process_outputs" not in vars(llm.llm_engine.output_processor)  # unwrapped
    assert [step[1:] for step in steps] == [
        [2, 2, 2, 0],
        [4, 7, 2, 0],
        [4, 10, 0, 2],
        [2, 5, 0, 1],
        [1, 1, 0, 1],
    ]
    summary = offline_sweep.timeline_summary(steps, requests=4)
    assert summary["engine_steps"] == 5
    assert summary["first_tokens_ms"] == pytest.approx(20.0)
    assert summary["half_finished_ms"] == pytest.approx(30.0)
    assert summary["last_token_ms"] == pytest.approx(80.0)
    # After the last first token (20 ms), steps of 10, 20 and 30 ms.
    assert summary["decode_step_ms"] == pytest.approx(20.0)


class FakeEngine:
    """subprocess.Popen of an offline_sweep engine: prints ``rows`` as the engine would."""

    def __init__(self, rows: list[dict], returncode: int = 0):
        self.stdout = ["a log line\n", *("ROW " + json.dumps(row) + "\n" for row in rows)]
        self.returncode = returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_engines(monkeypatch):
    """Every engine offline_sweep.main() starts prints the rows of ``fake_engines.rows``
    (a function of the engine's spec); ``fake_engines.specs`` lists their specs; the
    engines numbered in ``fake_engines.failing`` (from 0) exit with 1 before any row."""
    import types

    import offline_sweep

    state = types.SimpleNamespace(specs=[], rows=lambda spec: [], failing=set())

    def start(command, **kwargs):
        state.specs.append(json.loads(command[command.index("--arm-spec") + 1]))
        if len(state.specs) - 1 in state.failing:
            return FakeEngine([], returncode=1)
        return FakeEngine(state.rows(state.specs[-1]))

    monkeypatch.setattr(offline_sweep.subprocess, "Popen", start)
    return state


def test_offline_sweep_brackets_the_other_engines_with_the_first(
    fake_engines, monkeypatch, tmp_path
):
    import offline_sweep

    def print_rows(spec):
        engines = len(fake_engines.specs)
        return [{"concurrency": c, "tok_s": float(engines)} for c in spec["concurrency"]]

    fake_engines.rows = print_rows
    written = []
    monkeypatch.setattr(
        offline_sweep, "write_record", lambda path, rows, failed: written.append(list(rows))
    )
    argv = ["offline_sweep.py", "--arms", "nospec,dspark", "--concurrency", "1,16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--bracket", "--out", str(tmp_path / "o.json")])
    assert offline_sweep.main() == 0
    # No speculation, k=7, no speculation again.
    assert [spec["options"] for spec in fake_engines.specs] == [None, {}, None]
    # The record is rewritten after every row, so a run cut short keeps what it measured.
    assert [len(rows) for rows in written] == [1, 2, 3, 4, 5, 6]
    assert [(r["arm"], r.get("bracket"), r["tok_s"]) for r in written[-1]] == [
        ("nospec", "first", 1.0),
        ("nospec", "first", 1.0),
        ("dspark", None, 2.0),
        ("dspark", None, 2.0),
        ("nospec", "last", 3.0),
        ("nospec", "last", 3.0),
    ]


def test_offline_sweep_mirrors_a_shared_engines_arms(fake_engines, monkeypatch, tmp_path):
    """--mirror: a shared engine switches to its arms again in reverse order; an engine of
    one arm runs once."""
    import offline_sweep

    monkeypatch.setattr(offline_sweep, "write_record", lambda path, rows, failed: None)
    argv = ["offline_sweep.py", "--pair", "tiny", "--arms", "nospec,sps,sps-plain,dspark-fixed"]
    argv += ["--shared-engine", "--mirror", "--concurrency", "1", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", argv)
    assert offline_sweep.main() == 0
    nospec, shared = fake_engines.specs
    assert nospec["switch"] is None
    order = ["sps", "sps-plain", "dspark-fixed", "dspark-fixed", "sps-plain", "sps"]
    assert [name for name, _ in shared["switch"]] == order


def test_a_mirrored_engines_rows_are_numbered_by_pass(fake_llm, timed_arm, monkeypatch, capsys):
    from vllm_dspark.bench import engine_control

    switched = []
    monkeypatch.setattr(engine_control, "switch_capacity", lambda llm, **kw: switched.append(kw))
    order = [["a", {"capacity": "sps"}], ["b", {"capacity": "off"}]]
    timed_arm(
        dummy=True, prompt_len=8, min_requests=1, prompts="arithmetic", switch=order + order[::-1]
    )
    rows = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines() if "ROW " in line]
    assert [(row["arm"], row["pass"]) for row in rows] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert [kw["capacity"] for kw in switched] == ["sps", "off", "off", "sps"]


def test_an_interleaved_engine_pairs_its_arms_repeats(fake_llm, monkeypatch, capsys):
    """--interleave: repeat r of every arm (in turn, reversed on odd repeats) on the same
    prompts before repeat r + 1 of any; rows by concurrency then arm, each with its paired
    ratios; greedy checks name those rows."""
    import offline_sweep

    from vllm_dspark.bench import engine_control

    switched = []
    monkeypatch.setattr(engine_control, "switch_capacity", lambda llm, **kw: switched.append(kw))
    # Each wave of arm "a" takes 1 s, of "b" 2 s; every other clock reading is 1 s apart.
    now = itertools.count()
    monkeypatch.setattr(
        offline_sweep.time,
        "perf_counter",
        lambda: float(next(now) * (2 if switched and switched[-1]["capacity"] == "off" else 1)),
    )
    timed = {"a": [], "b": []}
    timed_repeat = offline_sweep.Engine.timed_repeat

    def record(engine, concurrency, repeat):
        arm = "b" if switched[-1]["capacity"] == "off" else "a"
        timed[arm].append((concurrency, repeat, len(fake_llm.batches)))
        return timed_repeat(engine, concurrency, repeat)

    monkeypatch.setattr(offline_sweep.Engine, "timed_repeat", record)
    spec = {
        "options": None,
        "target": "t",
        "dummy": True,
        "prompt_len": 8,
        "output_len": 10,
        "concurrency": [1, 2],
        "repeats": 3,
        "min_requests": 1,
        "prompts": "arithmetic",
        "switch": [["a", {"capacity": "sps"}], ["b", {"capacity": "off"}]],
        "interleave": True,
        "greedy_check": True,
    }
    offline_sweep.run_arm_here(spec)
    # Per concurrency: a b | b a | a b, then each row's timeline in its arm (no switch to
    # the arm already running); then the greedy checks, arm by arm.
    capacities = [kw["capacity"] for kw in switched]
    assert capacities == ["sps", "off", "sps", "off", "sps", "off"] * 2 + ["sps", "off"]
    assert [(c, r) for c, r, _ in timed["a"]] == [(c, r) for c, r, _ in timed["b"]]
    prompts = {arm: [fake_llm.batches[i] for *_, i in runs] for arm, runs in timed.items()}
    assert prompts["a"] == prompts["b"]
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line[4:]) for line in out if line.startswith("ROW ")]
    assert [(row["concurrency"], row["arm"]) for row in rows] == [
        (1, "a"),
        (1, "b"),
        (2, "a"),
        (2, "b"),
    ]
    assert [row["paired"] for row in rows] == [{"b": 2.0}, {"a": 0.5}] * 2
    assert rows[2]["tok_s_repeats"] == [20.0] * 3 and rows[3]["tok_s_repeats"] == [10.0] * 3
    checks = [json.loads(line[7:])["row"] for line in out if line.startswith("GREEDY ")]
    assert checks == [0, 2, 1, 3]


def test_interleaving_needs_a_shared_engine(monkeypatch, tmp_path, capsys):
    import offline_sweep

    argv = ["offline_sweep.py", "--arms", "sps,budget", "--interleave", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        offline_sweep.main()
    assert "--interleave" in capsys.readouterr().err


def test_an_engine_process_hands_over_rows_as_it_prints_them(monkeypatch, tmp_path, capsys):
    """A real process: rows arrive in order, a log longer than a pipe holds does not stall
    it, and a failing engine's exit code and stderr tail come back."""
    import offline_sweep

    engine = tmp_path / "engine.py"
    engine.write_text(
        "import sys\n"
        "print('ROW {\"concurrency\": 1}', flush=True)\n"
        "sys.stderr.write('x' * 200_000 + 'the end')\n"
        "print('not a row')\n"
        f"print({STARTUP_LOG!r})\n"
        "print('ROW {\"concurrency\": 16}')\n"
        "sys.exit(3)\n"
    )
    monkeypatch.setattr(offline_sweep, "__file__", str(engine))
    kept = []
    returncode, errors = offline_sweep.run_engine({}, tmp_path / "o.json", kept.append)
    assert kept == [{"concurrency": 1}, {"concurrency": 16}]
    assert returncode == 3 and errors.endswith("the end") and len(errors) == 3000
    # Start-up phases pass through, the rest of the log does not.
    passed = capsys.readouterr().out.splitlines()
    assert passed == [line for line in STARTUP_LOG.splitlines() if "not passed" not in line]


# Lines as an engine logs them (vLLM 0.26.0's own, and the plugin's).
STARTUP_LOG = "\n".join(
    [
        *(
            f"(EngineCore pid=7) INFO 12-08 03:00:00 [{where}] {message}"
            for where, message in (
                ("model_runner.py:306", "Model loading took 45.3 GiB and 61.2 seconds"),
                ("default_loader.py:1", "not passed: an ordinary line"),
                ("parallel_warmup.py:160", "vllm-dspark: DeepGEMM warmup of 31 weight shapes"),
                ("deepseek_v4_mhc_warmup.py:200", "Warming up DeepSeek V4 mHC TileLang kernels"),
                ("deepseek_v4_mhc_warmup.py:206", "mHC TileLang warmup finished in 60.00 seconds."),
                ("cutedsl_warmup.py:114", "CuTeDSL warmup compiled 3 units in 9.12 s."),
                ("model_runner.py:748", "Graph capturing finished in 56 secs, took 1.20 GiB"),
                ("core.py:331", "init engine (profile, create kv cache, warmup model) took 180 s"),
            )
        ),
        "INFO 12-08 03:03:02 [llm.py:1] not passed: the front end's line",
    ]
)


def test_the_stage_log_keeps_the_start_up_lines_the_sweep_passes_on():
    """gpu_stage.sh's quiet() drops vLLM's log lines but those of the plugin and the
    start-up phases, the same lines run_engine passes on."""
    stage = Path(__file__).parents[2] / "tools" / "device" / "gpu_stage.sh"
    quiet = stage.read_text().split("quiet() {", 1)[1].split("\n}", 1)[0]
    result = subprocess.run(
        ["bash", "-c", f"quiet() {{{quiet}\n}}; quiet"],
        input=STARTUP_LOG + "\n[rank0]: dropped\nROW kept\n",
        capture_output=True,
        text=True,
        check=True,
    )
    kept = [line for line in STARTUP_LOG.splitlines() if "not passed" not in line]
    assert result.stdout.splitlines() == [*kept, "ROW kept"]


LOCKSTEP_ENGINE = """
import json, os, pathlib, statistics, sys, time
spec = json.loads(sys.argv[sys.argv.index("--arm-spec") + 1])
options = spec["options"]
speed = 100.0 if options is None else 150.0
print("INFO a log line on stdout" + "." * 100_000, flush=True)  # more than a pipe holds
# Ready only once every engine has started: engines started one after another never are.
caches = pathlib.Path(os.environ["VLLM_CACHE_ROOT"])
caches.mkdir(parents=True)
for _ in range(200):
    if len(list(caches.parent.parent.glob("*/vllm"))) == 4:
        break
    time.sleep(0.05)
else:
    sys.exit("the other engines never started")
print("READY", flush=True)
repeats = []
for line in sys.stdin:
    command = json.loads(line)
    c = command["concurrency"]
    with open(os.environ["LOCKSTEP_LOG"], "a") as log:
        log.write(json.dumps([os.getpid(), command["do"], c, spec["gpu_memory_utilization"],
                              spec["kv_cache_memory_bytes"], str(caches)]))
        log.write("\\n")
    if command["do"] == "begin":
        repeats = []
        print("OK", flush=True)
    elif command["do"] == "time":
        if options and options.get("dspark_capacity") and c == 16:
            sys.exit("RuntimeError: lost the GPU")
        repeats.append(speed * (1 + command["repeat"]))  # every arm alike, repeat by repeat
        print(f"TIMED {repeats[-1]}", flush=True)
    else:
        row = {"concurrency": c, "tok_s": statistics.median(repeats), "tok_s_repeats": repeats}
        print("ROW " + json.dumps(row), flush=True)
"""


def test_lockstep_takes_every_engines_repeats_in_turn(monkeypatch, tmp_path):
    """--lockstep: engines started at once, each with its share of the GPU, a fixed KV
    cache and compile caches of its own, all alive at once; per concurrency
    repeat r of every engine before repeat r + 1 of any, forward then backward; rows
    carry their median ratio to every other engine over repeats of the same index; an arm
    named twice runs in two engines; an engine that dies leaves the rotation, the others
    go on."""
    import offline_sweep

    engine = tmp_path / "engine.py"
    engine.write_text(LOCKSTEP_ENGINE)
    monkeypatch.setattr(offline_sweep, "__file__", str(engine))
    log = tmp_path / "log"
    monkeypatch.setenv("LOCKSTEP_LOG", str(log))
    written = []
    monkeypatch.setattr(
        offline_sweep, "write_record", lambda path, rows, failed: written.append((rows, failed))
    )
    argv = ["offline_sweep.py", "--pair", "tiny", "--arms", "nospec,dspark,dspark,sps"]
    argv += ["--lockstep", "--concurrency", "1,16", "--repeats", "3", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", argv)
    assert offline_sweep.main() == 1
    rows, failed = written[-1]
    assert list(failed) == ["sps"] and "lost the GPU" in failed["sps"]
    commands = [json.loads(line) for line in log.read_text().splitlines()]
    assert {tuple(command[3:5]) for command in commands} == {(round(0.8 / 4, 3), 2 << 30)}
    assert len({command[5] for command in commands}) == 4
    engines = list(dict.fromkeys(pid for pid, *_ in commands))  # in the order they began
    timed = [engines.index(pid) for pid, do, c, *_ in commands if do == "time" and c == 1]
    assert timed == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3]
    timed = [engines.index(pid) for pid, do, c, *_ in commands if do == "time" and c == 16]
    assert timed[:3] == [0, 1, 2] and timed.count(3) == 1  # sps died on its first
    assert [(row["arm"], row.get("copy"), row["concurrency"]) for row in rows] == [
        ("nospec", None, 1),
        ("dspark", None, 1),
        ("dspark", 2, 1),
        ("sps", None, 1),
        ("nospec", None, 16),
        ("dspark", None, 16),
        ("dspark", 2, 16),
    ]
    assert rows[1]["paired"] == {"nospec": 1.5, "dspark#2": 1.0, "sps": 1.0}
    assert rows[4]["paired"] == {"dspark": 0.6667, "dspark#2": 0.6667}
    assert rows[4]["lockstep"] == ["nospec", "dspark", "dspark#2"]


def test_a_lockstep_engine_measures_the_prompts_a_sweep_engine_does(
    fake_llm, timed_arm, monkeypatch, capsys
):
    """An engine process started for --lockstep (run_lockstep_here) answers the driver's
    commands with the measurements run_arm_here takes: the same warm-ups, the same prompts
    per repeat, the same row."""
    import io

    import offline_sweep

    spec = {"dummy": True, "prompt_len": 8, "min_requests": 1, "prompts": "arithmetic"}
    timed_arm(**spec)  # on a fake clock: each wave 1 s
    alone = list(fake_llm.batches)
    sweep_row = json.loads(capsys.readouterr().out.split("ROW ", 1)[1])
    fake_llm.batches.clear()
    commands = [{"do": "begin"}, {"do": "time", "repeat": 0}, {"do": "time", "repeat": 1}]
    commands.append({"do": "row"})
    lines = "".join(json.dumps(c | {"concurrency": 2}) + "\n" for c in commands)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    spec |= {"options": None, "target": "t", "output_len": 10, "concurrency": [2], "repeats": 2}
    argv = ["offline_sweep.py", "--out", "o", "--arm-spec", json.dumps(spec | {"lockstep": True})]
    monkeypatch.setattr(sys, "argv", argv)
    assert offline_sweep.main() == 0
    replies = capsys.readouterr().out.splitlines()
    assert replies[:4] == ["READY", "OK", "TIMED 20.0", "TIMED 20.0"]
    row = json.loads(replies[4].removeprefix("ROW "))
    assert fake_llm.batches == alone
    assert row["tok_s_repeats"] == sweep_row["tok_s_repeats"] == [20.0, 20.0]
    assert row.keys() == sweep_row.keys() - {"wall_s"}


def test_offline_sweep_runs_engines_in_the_order_of_their_first_arm(
    fake_engines, monkeypatch, tmp_path
):
    """A shared engine stands where its first capacity arm does; its rows carry each arm's
    own name and the engine's label."""
    import offline_sweep

    def print_rows(spec):
        names = [name for name, _ in spec["switch"]] if spec["switch"] else [None]
        return [{"concurrency": 1, "tok_s": 1.0} | ({"arm": n} if n else {}) for n in names]

    fake_engines.rows = print_rows
    written = []
    monkeypatch.setattr(
        offline_sweep, "write_record", lambda path, rows, failed: written.append(list(rows))
    )
    arms = "nospec,sps-depth-plain,budget,dspark,sps-depth-plain-fp8,dynamic-sd"
    argv = ["offline_sweep.py", "--pair", "tiny", "--arms", arms, "--shared-engine"]
    monkeypatch.setattr(sys, "argv", [*argv, "--concurrency", "1", "--out", str(tmp_path / "o")])
    assert offline_sweep.main() == 0
    assert [(row["arm"], row.get("engine")) for row in written[-1]] == [
        ("nospec", None),
        ("sps-depth-plain", "sps-depth-plain+budget"),
        ("budget", "sps-depth-plain+budget"),
        ("dspark", None),
        ("sps-depth-plain-fp8", None),
        ("dynamic-sd", None),
    ]


def test_offline_sweep_runs_every_arm_with_the_drafts_asked_for(
    fake_engines, monkeypatch, tmp_path
):
    """--num-drafts 3: each speculating engine drafts 3 with the first 3 rates, from a
    drafter written with a block of 3; K other than 7 is refused where it cannot hold."""
    import offline_sweep

    monkeypatch.setattr(offline_sweep, "write_record", lambda path, rows, failed: None)
    out = ["--out", str(tmp_path / "o.json")]
    argv = ["offline_sweep.py", "--pair", "tiny", "--arms", "nospec,dspark", "--num-drafts", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, *out])
    assert offline_sweep.main() == 0
    nospec, dspark = map(offline_sweep.speculative_config, fake_engines.specs)
    assert nospec is None
    assert dspark["num_speculative_tokens"] == 3
    assert dspark["synthetic_acceptance_rates"] == [0.8, 0.62, 0.48]
    draft_config = json.loads((Path(dspark["model"]) / "config.json").read_text())
    assert draft_config["block_size"] == 3
    for refused in (["--pair", "embedded"], ["--arms", "dynamic-sd"], ["--num-drafts", "8"]):
        monkeypatch.setattr(sys, "argv", [*argv, *refused, *out])
        with pytest.raises(SystemExit):
            offline_sweep.main()


def test_offline_sweep_compares_every_ranks_admissions(fake_llm, monkeypatch, capsys):
    import offline_sweep
    import vllm

    from vllm_dspark.metrics import AdmissionCounts

    reads = iter(range(100))

    class TwoRankLLM(fake_llm):
        def __init__(self, **kwargs):
            assert kwargs["tensor_parallel_size"] == 2
            super().__init__(**kwargs)

        def collective_rpc(self, method, args=()):
            if method.__name__ == "_worker_gate_inputs":
                return [{"gate_open": False, "mean_survival": [0.5]}] * 2
            if method.__name__ == "_worker_trace":  # (start, stop): the first rank's steps
                tracing = args[0]
                return [None if tracing else [[2, 3, 2, 1.5, 10.0, 0.0]], [[9]]]
            # Reads before and after each concurrency: rank 1 admits one draft more than
            # rank 0 during the second (between reads 2 and 3).
            read = next(reads)
            return [{"admitted": read}, {"admitted": read + (read >= 3)}]

    monkeypatch.setattr(vllm, "LLM", TwoRankLLM)
    spec = {
        "options": {},
        "target": "t",
        "draft": "d",
        "dummy": False,
        "prompt_len": 8,
        "output_len": 4,
        "concurrency": [1, 2],
        "repeats": 1,
        "min_requests": 1,
        "prompts": "arithmetic",
        "switch": None,
        "tensor_parallel_size": 2,
        "num_drafts": 7,
    }
    offline_sweep.run_arm_here(spec)
    rows = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines() if "ROW " in line]
    assert [row["ranks_agree"] for row in rows] == [True, False]
    assert rows[0]["admission"] == dict(vars(AdmissionCounts(admitted=1)))
    assert rows[0]["gate"] == {"gate_open": False, "mean_survival": [0.5]}
    # The timeline batch's decode steps as the first rank decided them.
    assert rows[1]["timeline"]["decode_steps"] == [[2, 3, 2, 1.5, 10.0, 0.0]]


@pytest.fixture
def timed_arm(monkeypatch):
    """run_arm_here on the fake clock (each wave takes 1 s), for one engine without
    speculation at concurrency 2, two repeats; ``overrides`` change the spec."""
    import offline_sweep

    clock = iter(range(100))
    monkeypatch.setattr(offline_sweep.time, "perf_counter", lambda: float(next(clock)))
    spec = {
        "options": None,
        "target": "t",
        "output_len": 10,
        "concurrency": [2],
        "repeats": 2,
        "switch": None,
    }

    return lambda **overrides: offline_sweep.run_arm_here(spec | overrides)


def test_offline_sweep_runs_waves_of_held_out_windows_below_min_requests(
    fake_llm, timed_arm, capsys
):
    from vllm_dspark.demo import load_prompts

    batches = fake_llm.batches
    timed_arm(dummy=False, prompt_len=100, min_requests=5, prompts="heldout")
    row = json.loads(capsys.readouterr().out.split("ROW ", 1)[1])
    # Three warm-ups, then per repeat ceil(5 / 2) = 3 waves of 2 requests, each wave 1 s
    # on the fake clock: 60 tokens in 3 s.
    assert [len(batch) for batch in batches] == [8, 2, 2] + [2] * 6 + [2]  # + the timeline
    assert row["tok_s_repeats"] == [20.0, 20.0]
    # Every prompt is a 100-token window of the held-out text, none starting alike.
    stream = [token for prompt in load_prompts(num_prompts=None) for token in prompt]
    text = " ".join(map(str, stream))
    timed = [prompt for batch in batches[2:-1] for prompt in batch]
    assert all(len(p) == 100 and " ".join(map(str, p)) in text for p in timed)
    assert len({tuple(p[:16]) for p in timed}) == len(timed)


def test_offline_sweep_refill_submits_several_batches_to_an_engine_of_the_concurrency(
    fake_llm, timed_arm, monkeypatch, capsys
):
    """--refill 3 at concurrency 2: the engine runs 2 requests at once (max_num_seqs) and
    each wave submits 6, so that waiting requests join as others finish."""
    import offline_sweep

    engines = []

    class Recording(fake_llm):
        def __init__(self, **kwargs):
            engines.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(sys.modules["vllm"], "LLM", Recording)
    timed_arm(
        dummy=True, prompt_len=8, min_requests=12, prompts="arithmetic", refill=3, max_num_seqs=2
    )
    row = json.loads(capsys.readouterr().out.split("ROW ", 1)[1])
    assert engines[0]["max_num_seqs"] == 2
    # Warm-ups (8, 2, 2), per repeat two waves of 6, the timeline's wave of 6.
    assert [len(batch) for batch in Recording.batches] == [8, 2, 2] + [6] * 4 + [6]
    # Per repeat 2 waves x 6 requests x 10 tokens, each wave 1 s on the fake clock.
    assert row["refill"] == 3 and row["tok_s_repeats"] == [60.0, 60.0]
    monkeypatch.setattr(sys, "argv", ["offline_sweep.py", "--refill", "2", "--out", "o.json"])
    with pytest.raises(SystemExit):  # four concurrencies, one engine size
        offline_sweep.main()


def test_dynamic_sd_table_takes_the_best_k_per_batch_size_as_dynamic_sd_runs_it():
    from tune_dynamic_sd import dynamic_sd_ratios, table_from_ratios

    def row(arm, concurrency, step_ms, draft_ms=None, acceptance=None):
        phases = {"draft_graph": draft_ms}
        return {
            "arm": arm,
            "concurrency": concurrency,
            "step_ms_median": step_ms,
            "acceptance_length": acceptance,
            "phases_ms": phases,
        }

    breakdown = {
        "rows": [
            row("nospec", 1, 5.0),
            row("dspark-k1", 1, 6.0, 0.5, 1.8),
            row("dspark-k7", 1, 7.0, 1.0, 3.5),
            row("nospec", 256, 10.0),
            # As a fixed-k engine k=1 beats no speculation (1.125x), but Dynamic SD's
            # drafter computes all 7 drafts (6 ms here): 0.857x. k=3: 0.935x, the best.
            row("dspark-k1", 256, 16.0, 1.0, 1.8),
            row("dspark-k3", 256, 28.0, 3.0, 2.9),
            row("dspark-k7", 256, 50.0, 6.0, 3.9),
        ]
    }
    # An offline sweep: end-to-end rows, K in the admission record. Its K=7 row counts as
    # it ran; its k=3 row has no phases to charge the 7-draft proposal to, so it is left out.
    sweep = {
        "rows": [
            {"arm": "nospec", "concurrency": 16, "tok_s": 1000.0, "admission": {"num_drafts": 0}},
            {"arm": "dspark", "concurrency": 16, "tok_s": 1600.0, "admission": {"num_drafts": 7}},
            {"arm": "dspark", "concurrency": 16, "tok_s": 1900.0, "admission": {"num_drafts": 3}},
            {"arm": "budget", "concurrency": 16, "tok_s": 9999.0, "admission": {"num_drafts": 7}},
        ]
    }
    ratios = dynamic_sd_ratios([breakdown, sweep], engine_drafts=7)
    assert set(ratios) == {1, 16, 256}
    assert ratios[1] == pytest.approx({1: 1.8e3 / 6.5 / 200, 7: 2.5})
    assert ratios[16] == {7: 1.6}
    assert ratios[256] == pytest.approx(
        {1: 256 * 1.8e3 / 21 / 25600, 3: 256 * 2.9e3 / 31 / 25600, 7: 256 * 3.9e3 / 50 / 25600}
    )
    # Boundaries at geometric means (4 between 1 and 16, 64 between 16 and 256); at 256 the
    # best k though below no speculation: Dynamic SD cannot switch speculation off.
    assert table_from_ratios(ratios) == [[1, 64, 7], [65, 4096, 3]]
    # An engine of K=3: k=7 rows are not its to run, k=3 rows count as they ran.
    ratios = dynamic_sd_ratios([breakdown, sweep], engine_drafts=3)
    assert ratios[16] == {3: 1.9}
    assert ratios[256][3] == pytest.approx(256 * 2.9e3 / 28 / 25600)
    assert 7 not in ratios[256]


def test_the_sweeps_dynamic_sd_arm_runs_the_tuned_table():
    import offline_sweep

    table = json.loads(
        (Path(offline_sweep.__file__).parent / "results" / "dynamic_sd_table.json").read_text()
    )
    arm = offline_sweep.ARMS["dynamic-sd"]["num_speculative_tokens_per_batch_size"]
    assert arm == table["num_speculative_tokens_per_batch_size"]
    assert arm[0][0] == 1 and arm[-1][1] >= 256
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(arm))  # contiguous ranges


def test_batch_steps_walk_a_request_and_a_batch():
    import numpy as np
    from batch_steps import batch_row

    from lab.tiny_pair.evaluate import greedy_walk

    # 128 output tokens: the prefill commits the first, decode anchors 0..126 the rest.
    K, output_len = 7, 128
    every = np.ones((output_len - 1, K), dtype=bool)
    none = np.zeros((output_len - 1, K), dtype=bool)
    assert list(greedy_walk(every)) == [(a, K) for a in range(0, 127, K + 1)]  # 16 steps
    assert list(greedy_walk(none)) == [(a, 0) for a in range(output_len - 1)]
    half = none.copy()
    half[:, :3] = True  # 4 tokens a step
    assert len(list(greedy_walk(half))) == -(-(output_len - 1) // 4)
    # Two batches of three requests: per request, its steps' expected drafts.
    first = [[3.0] * 16, [0.5] * 127, [2.0] * 32]
    row = batch_row(3, [first, [[3.0] * 16] * 3], output_len)
    assert row["batch_decode_steps"] == [127, 16]  # a batch lasts as its slowest request
    assert row["proposals_per_batch"] == [175, 48]
    assert row["occupancy_median_batch"][:16] == [3] * 16
    assert row["occupancy_median_batch"][16:32] == [2] * 16
    assert row["occupancy_median_batch"][32:] == [1] * 95
    assert row["acceptance_length"] == round(127 * 6 / 223, 3)
    # 143 steps in all: the second batch's 16 (mean 3, worst 3), the first's 16 (mean 11/6,
    # worst 0.5), 16 (mean 1.25, worst 0.5, 2 of 3 decoding) and 95 (0.5, alone).
    # Each request's expectation is constant here, so its mean so far is the same.
    assert row["expected_drafts_median_step"] == {
        "all_steps": {"mean_request": 0.5, "worst_request": 0.5, "worst_request_mean_so_far": 0.5},
        "half_full_steps": {
            "mean_request": round(11 / 6, 3),
            "worst_request": 0.5,
            "worst_request_mean_so_far": 0.5,
        },
    }
    assert row["slowest_request_drafts_per_step"] == [0.0, round(127 / 16 - 1, 3)]
    # A request whose drafting improves: its mean so far trails its latest expectation.
    rising = batch_row(1, [[[0.0, 1.0, 2.0]]], 4)["expected_drafts_median_step"]["all_steps"]
    assert rising == {"mean_request": 1.0, "worst_request": 1.0, "worst_request_mean_so_far": 0.5}


def test_an_engine_settles_over_every_concurrency_before_it_measures(fake_llm, monkeypatch):
    """Every engine first serves every concurrency once, unrecorded (full length), so that
    the first arm measured is not the one that meets a batch size first (and capacity
    control does not plan with a cold fit of its step costs)."""
    import offline_sweep

    fake_llm.batches.clear()
    spec = {
        "options": None,
        "target": "t",
        "dummy": True,
        "prompt_len": 8,
        "output_len": 4,
        "concurrency": [1, 3],
        "repeats": 1,
        "min_requests": 1,
        "prompts": "arithmetic",
        "switch": None,
    }
    offline_sweep.run_arm_here(spec)
    # The engine's warm-up, the settling pass, then per concurrency a short warm-up, one
    # measured batch and its untimed timeline.
    assert [len(batch) for batch in fake_llm.batches] == [8, 1, 3, 1, 1, 1, 3, 3, 3]


def test_the_capacity_ceiling_admits_what_pays_and_only_that():
    import torch
    from capacity_ceiling import K, best_step, end_to_end_ceiling

    survival = torch.full((4, K), 0.9).cumprod(dim=1)
    draft_ms = {depth: 0.0 for depth in range(1, K + 1)}
    # Verification free at any size: every slot of the full depth pays.
    free = {"forward_ms": {4: 1.0, 64: 1.0}, "nospec_step_ms": 1.0, "draft_ms": draft_ms}
    rate, depth, admitted = best_step(survival, free)
    assert (depth, admitted) == (K, 4 * K)
    assert rate == pytest.approx(4 + 4 * float(survival[0].sum()))
    # Each verified token costs as much as a whole step: no draft pays.
    steep = dict(free, forward_ms={4: 1.0, 64: 16.0})
    assert best_step(survival, steep)[1:] == (0, 0)
    # A verified token at half a step's cost per token: the likelier drafts pay, the
    # unlikelier do not, and each request keeps the same prefix (equal survivals).
    half = dict(free, forward_ms={4: 1.0, 32: 4.5})
    rate, _, admitted = best_step(survival, half)
    assert 0 < admitted < 4 * K and admitted % 4 == 0 and rate > 4.0
    assert end_to_end_ceiling(1.0, 100.0, 4, 128, 10.0) == pytest.approx(1.0)
    # A batch that is all decode steps speeds up by the whole decode ceiling.
    assert end_to_end_ceiling(2.0, 4 * 128 / (1.27), 4, 128, 10.0) == pytest.approx(2.0)


def test_the_ceilings_speculative_forward_carries_what_verifying_its_tokens_adds(tmp_path):
    """Logits and rejection sampling over R + N tokens, and the drafter's context-K/V
    store, are paid by any speculative step: the ceiling's forward at each token count
    carries their measured growth over a step without speculation."""
    from capacity_ceiling import DEPTH_SOURCE, FORWARD_SOURCES, K, measured_costs

    phases = {
        "nospec": {"target_forward": 10.0, "logits_rejection": 0.5},
        "dspark-k1": {"target_forward": 15.0, "logits_rejection": 1.0, "draft_context_kv": 0.3},
        "dspark-k3": {"target_forward": 25.0, "logits_rejection": 2.0, "draft_context_kv": 0.4},
        "conf-k7": {"target_forward": 45.0, "logits_rejection": 3.5, "draft_context_kv": 0.7},
    }
    files: dict[str, list] = {}
    for name, arm in FORWARD_SOURCES.values():
        row = {"arm": arm, "concurrency": 4, "phases_ms": phases[arm], "step_ms_median": 11.0}
        files.setdefault(name, []).append(row)
    files[DEPTH_SOURCE] = [
        {"concurrency": 4, "depth": d, "draft_ms": 1.0 + 0.1 * d} for d in range(1, K + 1)
    ]
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps({"rows": rows}))
    costs = measured_costs(tmp_path, 4)
    assert costs["forward_ms"] == pytest.approx(
        {4: 10.0, 8: 15.0 + 0.5 + 0.3, 16: 25.0 + 1.5 + 0.4, 32: 45.0 + 3.0 + 0.7}
    )
    assert costs["nospec_step_ms"] == 11.0


def test_a_drained_batch_lasts_until_its_slowest_request():
    from capacity_ceiling import drain

    def unit_step(num_reqs):
        return 1.0

    # Every draft accepted: no spread between requests, ceil(127 / 4) steps of 4 tokens.
    assert drain(unit_step, [1.0, 1.0, 1.0], 3, 8, 128, trials=2) == (32.0, 32.0)
    # None accepted: one token a step, as without speculation.
    assert drain(unit_step, [0.0], 1, 8, 128, trials=2) == (127.0, 127.0)
    # Acceptance drawn per request: a batch of many waits for its slowest, so it lasts
    # longer than one request does on average, and its steps get cheaper as it drains.
    rates = [0.8, 0.62, 0.48]
    alone, _ = drain(unit_step, rates, 3, 1, 128, trials=200)
    many, _ = drain(unit_step, rates, 3, 256, 128, trials=8)
    assert many > alone * 1.1
    steps, ms = drain(lambda num_reqs: num_reqs / 256, rates, 3, 256, 128, trials=8)
    assert ms < steps


def test_the_oracle_drafts_while_it_pays_and_its_batch_drains_to_the_slowest_request():
    from capacity_ceiling import K, oracle_drain
    from offline_sweep import DEFAULT_RATES

    rates = [float(r) for r in DEFAULT_RATES.split(",")]

    def costs(verified_token_ms: float):
        def at(num_reqs: int) -> dict:
            tokens = range(num_reqs, num_reqs * (1 + K) + 1)
            forward = {t: 1.0 + verified_token_ms * (t - num_reqs) for t in tokens}
            draft_ms = dict.fromkeys(range(1, K + 1), 0.0)
            return {"forward_ms": forward, "nospec_step_ms": 1.0, "draft_ms": draft_ms}

        return at

    # Drafts cost nothing: every step verifies all K, and a batch of 32 lasts longer than
    # one request does (its slowest request), at 1 ms a step.
    alone, _ = oracle_drain(costs(0.0), rates, 1, 128, trials=32)
    steps, ms = oracle_drain(costs(0.0), rates, 32, 128, trials=4)
    assert 127 / 4.5 < alone < 127 / 3 and steps > alone and ms == steps
    # Each verified draft costs a whole step: none pays, the batch runs 127 plain steps.
    assert oracle_drain(costs(1.0), rates, 32, 128, trials=2) == (127.0, 127.0)


def test_a_failed_engine_shows_its_engine_cores_traceback():
    from offline_sweep import failure_excerpt, failure_line

    core = "(EngineCore pid=7) "
    stderr = "\n".join(
        [
            f"{core}INFO loading",
            f"{core}Traceback (most recent call last):",
            f"{core}  File 'old.py'",
            f"{core}Traceback (most recent call last):",
            f'{core}  File "vllm/config/vllm.py", line 679, in _get_quantization_config',
            f"{core}TypeError: missing 'args'",
            *(f"  frame {i} of the front end" for i in range(400)),
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    excerpt = failure_excerpt(stderr)
    assert excerpt.startswith(f"{core}Traceback")
    assert "TypeError: missing 'args'" in excerpt and "old.py" not in excerpt
    assert excerpt.endswith("See root cause above.")
    # What the record's failed_arms keeps: the engine core's error, not the front end's.
    assert failure_line(excerpt, 1) == f"{core}TypeError: missing 'args'"
    assert failure_line("RuntimeError: no core", 1) == "RuntimeError: no core"
    assert failure_line("", 3) == "exit code 3"
    # Without an engine-core traceback: the tail alone.
    assert failure_excerpt("short failure") == "short failure"


def test_an_arm_that_fails_to_start_leaves_the_others_running(fake_engines, monkeypatch, tmp_path):
    import offline_sweep

    fake_engines.rows = lambda spec: [{"concurrency": 1, "tok_s": 1.0}]
    fake_engines.failing = {1}
    out = tmp_path / "o.json"
    argv = ["offline_sweep.py", "--arms", "nospec,dspark-fp8-backbone,dspark", "--concurrency", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert offline_sweep.main() == 1
    record = json.loads(out.read_text())
    assert [row["arm"] for row in record["rows"]] == ["nospec", "dspark"]
    assert record["failed_arms"] == {"dspark-fp8-backbone": "exit code 1"}


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_speculation_schedules_less_of_the_token_budget(engine_config, model_dirs, method):
    """vLLM holds (K - 1) slots per sequence of max_num_batched_tokens for drafting, so a
    speculating engine schedules less per step than one without speculation, whatever the
    budget the sweep's --max-num-batched-tokens gives every arm."""
    from offline_sweep import engine_kwargs

    assert "max_num_batched_tokens" not in engine_kwargs("m")
    speculative = {"method": method, "model": model_dirs[method], "num_speculative_tokens": 7}
    for total in (16384, 20480):
        tokens = engine_kwargs("m", max_num_batched_tokens=total)["max_num_batched_tokens"]
        config = engine_config(speculative, max_num_seqs=256, max_num_batched_tokens=tokens)
        assert config.scheduler_config.max_num_scheduled_tokens == total - 6 * 256
        plain = engine_config(None, max_num_seqs=256, max_num_batched_tokens=tokens)
        assert plain.scheduler_config.max_num_scheduled_tokens in (None, total)
