"""`vllm-dspark demo`: its arguments are checked before anything loads, the CPU path runs the
PyTorch reference end to end (lossless, every section), and the GPU path's report, record
and plot are built right from arm rows (no GPU needed)."""

import contextlib
import io
import json
import math
import subprocess
import sys
import time

import pytest
import torch

from vllm_dspark import cli
from vllm_dspark.cli import main
from vllm_dspark.demo import EMBEDDED_PAIR, draft_block_size

pytestmark = pytest.mark.skipif(
    not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"
)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--k", "0"], "--k"),
        (["--k", str(draft_block_size() + 1)], "--k"),
        (["--prompts", "-5"], "--prompts"),
        (["--prompts", "0"], "--prompts"),
        (["--prompts", "100000"], "--prompts"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--max-tokens", "ten"], "--max-tokens"),
        (["--concurrency", "1,0"], "--concurrency"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--repeats", "0"], "--repeats"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "float8"], "--dtype"),
        (["--json", "/no/such/folder/demo.json"], "--json"),
        (["--plot", "/no/such/folder/demo.png"], "--plot"),
    ],
)
def test_bad_demo_arguments_exit_2_naming_the_argument(args, named, capsys, monkeypatch):
    def must_not_run(*_args, **_kwargs):
        raise AssertionError("a bad argument got past validation")

    monkeypatch.setattr(cli, "run_demo", must_not_run)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    assert time.perf_counter() - start < 2.0
    error = capsys.readouterr().err
    assert f"argument {named}" in error, error


def test_bad_arguments_fail_before_torch_or_vllm_loads():
    """In a fresh interpreter: the error comes before torch or vLLM is imported."""
    probe = (
        "import sys\n"
        "from vllm_dspark.cli import main\n"
        "try:\n"
        "    main(['demo', '--k', '0', '--prompts', '-5'])\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'torch' in sys.modules, 'vllm' in sys.modules)\n"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "argument --k" in done.stderr
    assert time.perf_counter() - start < 30.0


def test_good_arguments_are_parsed():
    args = cli.build_parser().parse_args(
        ["demo", "--k", "3", "--concurrency", "64,1,64", "--max-tokens", "2"]
    )
    assert (args.k, args.concurrency, args.max_tokens, args.device) == (3, [1, 64], 2, "auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_path_without_gpu_points_to_cpu_and_doctor(capsys):
    assert main(["demo", "--device", "gpu"]) == 1
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "--device cpu" in out and "vllm-dspark doctor" in out


# --- the CPU path -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_demo(tmp_path_factory):
    """The whole CPU demo through the command line, 3 prompts of 16 tokens, K=7."""
    record = tmp_path_factory.mktemp("demo") / "cpu.json"
    argv = ["demo", "--device", "cpu", "--prompts", "3", "--max-tokens", "16"]
    argv += ["--concurrency", "1,16", "--json", str(record), "--plot", str(record) + ".png"]
    report = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(report):
        code = main(argv)
    seconds = time.perf_counter() - start
    return code, report.getvalue(), json.loads(record.read_text()), seconds


def test_cpu_demo_runs_every_section_and_is_lossless(cpu_demo):
    code, report, record, seconds = cpu_demo
    assert code == 0
    print(f"CPU demo, 3 prompts x 16 tokens: {seconds:.1f} s")
    for section in (
        "CPU reference (PyTorch), not vLLM",
        "One DSpark step",
        "Acceptance:",
        "Confidence calibration",
        "Lossless:",
        "Capacity modes",
        "vllm-dspark doctor",
        "vllm-dspark demo",
    ):
        assert section in report, section
    assert record["lossless"] == {"prompts": 3, "identical": 3}
    plot = report.split("plot: ")[1].split()[0]
    assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "3/3 prompts (identical)" in report
    acceptance = record["acceptance"]
    assert 1.0 <= acceptance["acceptance_length"] <= 1 + 7
    # Unconditional per-position acceptance cannot rise along the block.
    shares = acceptance["per_position_acceptance"]
    assert all(a >= b for a, b in zip(shares, shares[1:], strict=False))
    assert math.isclose(acceptance["acceptance_length"], 1 + sum(shares))
    assert record["calibration"]["observed_survival"] == pytest.approx(shares)


def test_cpu_demo_capacity_table_follows_the_modes(cpu_demo):
    _, _, record, _ = cpu_demo
    capacity = record["capacity"]
    for load in ("1", "16"):
        assert capacity["off"][load]["drafts_per_request"] == 7
        # ceil(R * 7 * 0.5) slots over R requests.
        assert capacity["budget"][load]["drafts_per_request"] == pytest.approx(
            math.ceil(int(load) * 3.5) / int(load)
        )
        for mode in ("threshold", "sps"):
            assert 0 <= capacity[mode][load]["drafts_per_request"] <= 7
        # Verifying fewer drafts can only keep or lose accepted tokens.
        for mode in ("budget", "threshold", "sps"):
            assert (
                capacity[mode][load]["tokens_per_step"]
                <= capacity["off"][load]["tokens_per_step"] + 1e-9
            )


def test_speculative_greedy_equals_plain_greedy_with_fewer_drafts():
    from vllm_dspark.demo import load_prompts
    from vllm_dspark.demo.cpu import one_thread, plain_greedy, speculative_greedy
    from vllm_dspark.tiny_pair.reference import load_reference_pair

    target, drafter, temperatures = load_reference_pair(EMBEDDED_PAIR)
    prompts = load_prompts(num_prompts=2)
    with one_thread():
        plain = plain_greedy(target, prompts, 12)
        walks = [speculative_greedy(target, drafter, temperatures, p, 12, k=2) for p in prompts]
    for walk, expected in zip(walks, plain, strict=True):
        assert walk.output == expected
        assert all(len(step.drafts) == 2 and step.accepted <= 2 for step in walk.steps)
        # The first token comes from the prompt's forward, each step adds accepted + 1.
        assert 1 + sum(step.accepted + 1 for step in walk.steps) >= 12


def test_admission_takes_threshold_and_sps_budgets_from_the_previous_proposal():
    from vllm_dspark.capacity.allocation import sps_table_from_curve
    from vllm_dspark.demo.cpu import admitted_drafts

    sure = torch.ones(4, 3)
    doubtful = torch.full((4, 3), 0.1).cumprod(dim=-1)
    flat = sps_table_from_curve([[1, 100.0], [64, 100.0]], 64)
    # Threshold 0.5: a confident previous proposal admits every slot of a doubtful one.
    assert admitted_drafts("threshold", sure, doubtful, flat).tolist() == [3, 3, 3, 3]
    assert admitted_drafts("threshold", doubtful, sure, flat).tolist() == [0, 0, 0, 0]
    # sps on a flat curve: every draft is free, so it admits all; off always all.
    assert admitted_drafts("sps", doubtful, sure, flat).tolist() == [3, 3, 3, 3]
    assert admitted_drafts("off", doubtful, doubtful, flat).tolist() == [3, 3, 3, 3]
    # budget 0.5 of 12 slots: the 6 best of the current proposal, contiguous per request.
    current = torch.tensor([[0.9, 0.8, 0.7], [0.2, 0.1, 0.05], [0.6, 0.5, 0.4], [0.3, 0.1, 0.1]])
    assert admitted_drafts("budget", sure, current, flat).tolist() == [3, 0, 3, 0]


# --- the GPU path's report, from fake arm rows ----------------------------------------------


def fake_results(identical_adaptive: bool = True, divergence_gap: float = 0.5):
    from vllm_dspark.demo.gpu import ArmResult, ArmRow, demo_arms

    arms = demo_arms(7)
    outputs = [[1, 2, 3], [4, 5, 6]]
    changed = outputs if identical_adaptive else [[1, 2, 3], [4, 5, 9]]
    tok_s = {"nospec": (100.0, 2000.0), "fixed": (150.0, 2400.0), "adaptive": (165.0, 2640.0)}
    results = []
    for spec in arms:
        rows = []
        for load, speed in zip((1, 64), tok_s[spec.key], strict=True):
            row = ArmRow(spec.key, spec.name, load, speed, [speed * 0.98, speed, speed * 1.01])
            row.outputs = changed if spec.key == "adaptive" and load == 64 else outputs
            if spec.options is None:  # no speculation: its top-two gaps, the third differing
                row.top_two_gaps = [[3.0, 2.0, 1.0], [2.0, 1.5, divergence_gap]]
            if spec.options is not None:
                row.acceptance_length = 3.1
                row.per_position_acceptance = [0.8, 0.5, 0.3, 0.2, 0.15, 0.1, 0.05]
                row.drafts_per_request = 7.0 if spec.key == "fixed" else 6.4
            rows.append(row)
        calibration = None
        if spec.key == "adaptive":
            calibration = {
                "trials": [100] * 7,
                "ece": [0.02] * 7,
                "auroc": [0.85] * 6 + [float("nan")],
                "mean_predicted": [0.8, 0.5, 0.3, 0.2, 0.15, 0.1, 0.05],
                "mean_observed": [0.79, 0.5, 0.31, 0.2, 0.14, 0.1, 0.06],
                "ece_noise_floor": [0.01] * 7,
            }
        results.append(ArmResult(spec, 70.0, rows, calibration))
    return results


def fake_settings(dtype: str = "float32"):
    from vllm_dspark.demo.gpu import ADAPTIVE_OPTIONS
    from vllm_dspark.demo.report import RunSettings

    return RunSettings(
        command="vllm-dspark demo --json demo.json",
        prompts=64,
        max_tokens=128,
        k=7,
        dtype=dtype,
        concurrency=[1, 64],
        repeats=3,
        adaptive_options=ADAPTIVE_OPTIONS,
        device="NVIDIA H100 80GB HBM3",
        vllm_version="0.26.0",
    )


def test_gpu_rows_compare_each_arm_with_no_speculation_and_fixed_k():
    from vllm_dspark.demo.report import compare_rows

    rows = compare_rows([row for result in fake_results(False) for row in result.rows])
    by_key = {(row["arm"], row["concurrency"]): row for row in rows}
    adaptive = by_key[("adaptive", 1)]
    assert adaptive["vs_nospec"] == pytest.approx(1.65)
    assert adaptive["vs_fixed"] == pytest.approx(1.1)
    assert adaptive["greedy_identical"] is True and adaptive["identical_requests"] == 2
    changed = by_key[("adaptive", 64)]
    assert changed["greedy_identical"] is False and changed["identical_requests"] == 1
    assert changed["divergence_gaps"] == [0.5] and changed["differs_only_at_near_ties"] is False
    assert by_key[("nospec", 64)]["greedy_identical"] is None
    assert by_key[("fixed", 64)]["vs_nospec"] == pytest.approx(1.2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_report_and_record(dtype, tmp_path):
    from vllm_dspark.demo.report import compare_rows, demo_record, format_gpu_report

    results = fake_results(False)
    settings = fake_settings(dtype)
    rows = compare_rows([row for result in results for row in result.rows])
    report = "\n".join(format_gpu_report(settings, rows, results, 251.0))
    assert "NVIDIA H100 80GB HBM3" in report and "vLLM 0.26.0" in report
    assert "adaptive (sps)" in report and "1.65x" in report and "1.10x" in report
    assert "1/2 NO" in report and "2/2 yes" in report
    assert "dspark_capacity=sps, dspark_varlen_verify=true" in report
    assert "Confidence head" in report and "AUROC" in report
    assert ("near ties" in report) == (dtype != "float32")
    record = demo_record(settings, rows, results, 251.04)
    text = json.dumps(record, allow_nan=False)  # NaN became null
    assert json.loads(text)["confidence_calibration"]["adaptive"]["auroc"][-1] is None
    assert record["wall_s"] == 251.0 and record["device"] == settings.device
    assert record["vllm_version"] == "0.26.0" and record["command"] == settings.command
    assert record["date"] and record["settings"]["dtype"] == dtype
    assert len(record["arms"]) == 6
    for arm in record["arms"]:
        assert {
            "name",
            "concurrency",
            "tok_s",
            "greedy_identical",
            "acceptance_length",
            "drafts_per_request",
        } <= set(arm)


def test_gpu_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from vllm_dspark.demo.report import compare_rows, plot_throughput

    rows = compare_rows([row for result in fake_results() for row in result.rows])
    path = tmp_path / "demo.png"
    plot_throughput(rows, str(path), fake_settings())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drafts_per_request_reads_the_plugin_where_it_compacted():
    from vllm_dspark.demo.gpu import drafts_per_request
    from vllm_dspark.metrics import AdmissionCounts, SpecDecodeCounts

    stock = SpecDecodeCounts(drafts=10, draft_tokens=70, accepted_tokens=21)
    assert drafts_per_request(stock, AdmissionCounts()) == 7.0
    compacted = AdmissionCounts(proposed=70, admitted=45, num_drafts=7, steps=10)
    assert drafts_per_request(stock, compacted) == pytest.approx(4.5)
    assert drafts_per_request(SpecDecodeCounts(), AdmissionCounts()) is None


def test_requests_repeat_waves_until_enough_requests():
    from vllm_dspark.demo.gpu import MIN_REQUESTS_PER_REPEAT, requests_for

    pool = [[i] for i in range(5)]
    one = requests_for(1, pool)
    assert len(one) == MIN_REQUESTS_PER_REPEAT and all(len(wave) == 1 for wave in one)
    assert [wave[0] for wave in one][:6] == [[0], [1], [2], [3], [4], [0]]
    (wave,) = requests_for(16, pool)
    assert len(wave) == 16


def test_outputs_differing_only_at_near_ties_are_reported_as_such():
    from vllm_dspark.demo.report import compare_rows, format_gpu_report

    results = fake_results(False, divergence_gap=0.03)
    rows = compare_rows([row for result in results for row in result.rows])
    changed = next(r for r in rows if (r["arm"], r["concurrency"]) == ("adaptive", 64))
    assert changed["differs_only_at_near_ties"] is True and not changed["greedy_identical"]
    report = "\n".join(format_gpu_report(fake_settings("bfloat16"), rows, results, 251.0))
    assert "1/2 near ties" in report and "widest here: 0.030" in report


def test_divergence_gaps_read_the_first_differing_token():
    from vllm_dspark.demo.report import divergence_gaps

    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    outputs = [[1, 2, 0, 0], [5, 6, 7, 8], [9, 0, 9, 9]]
    gaps = [[0.9, 0.8, 0.07, 0.6], [1.0] * 4, None]  # the third rerun did not reproduce
    assert divergence_gaps(outputs, reference, gaps) == [0.07, None]
    assert divergence_gaps(reference, reference, gaps) == []


def test_first_difference_is_the_shorter_length_when_one_continues_the_other():
    from vllm_dspark.demo.report import first_difference

    assert first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [7]) == 0
    # An output that stops early has no differing token, so no gap is read for it.
    from vllm_dspark.demo.report import divergence_gaps

    assert divergence_gaps([[1, 2]], [[1, 2, 3]], [[0.5, 0.5, 0.01]]) == [None]
