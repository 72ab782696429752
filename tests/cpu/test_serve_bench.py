"""benchmarks/serve_bench.py without a GPU: presets, the command lines it gives `vllm serve`
and `vllm bench serve` (parsed by vLLM's own parsers), counters, rows, plot, tokenizer."""

import contextlib
import datetime
import http.server
import io
import json
import sys
import tempfile
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import serve_bench  # noqa: E402
from serve_bench import (  # noqa: E402
    ARM_PRESETS,
    SETUP_ARMS,
    bench_command,
    earlier_record,
    embedded_models,
    parse_arms,
    parse_request_rates,
    point_row,
    server_args,
    shape_models,
    spec_decode_counts,
    write_tokenizer,
)

from vllm_dspark.config import resolve_options  # noqa: E402
from vllm_dspark.demo import EMBEDDED_PAIR  # noqa: E402
from vllm_dspark.metrics import AdmissionCounts, SpecDecodeCounts  # noqa: E402

# /metrics of a server with two engines (vLLM's Prometheus text: counters end in _total,
# each with a _created timestamp), K = 3.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 4.0
"""

# What `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl
# --metric-percentiles 50,90` writes (vLLM 0.26.0, benchmarks/serve.py: the run's setup,
# then benchmark()'s result without the per-request lists), for a speculating server at
# 16 requests per second.
RESULT = {
    "date": "20261206-120000",
    "endpoint_type": "vllm",
    "backend": "vllm",
    "label": None,
    "model_id": "/tmp/qwen3-8b/target",
    "tokenizer_id": "/tmp/qwen3-8b/target",
    "num_prompts": 480,
    "request_rate": 16.0,
    "burstiness": 1.0,
    "max_concurrency": None,
    "duration": 31.2,
    "completed": 480,
    "failed": 0,
    "total_input_tokens": 61440,
    "total_output_tokens": 61440,
    "request_throughput": 15.38,
    "request_goodput": None,
    "output_throughput": 1969.23,
    "total_token_throughput": 3938.46,
    "max_output_tokens_per_s": 2650.0,
    "max_concurrent_requests": 41,
    "rtfx": 0.0,
    "spec_decode_acceptance_rate": 42.1,
    "spec_decode_acceptance_length": 3.95,
    "spec_decode_num_drafts": 15555,
    "spec_decode_draft_tokens": 108885,
    "spec_decode_accepted_tokens": 45885,
    "spec_decode_per_position_acceptance_rates": [0.8, 0.62, 0.48, 0.37, 0.28, 0.21, 0.16],
    "mean_ttft_ms": 41.2,
    "median_ttft_ms": 38.4,
    "std_ttft_ms": 9.1,
    "p50_ttft_ms": 38.4,
    "p90_ttft_ms": 55.73,
    "mean_tpot_ms": 6.21,
    "median_tpot_ms": 6.05,
    "std_tpot_ms": 0.8,
    "p50_tpot_ms": 6.05,
    "p90_tpot_ms": 7.4412,
    "mean_itl_ms": 22.9,
    "median_itl_ms": 21.7,
    "std_itl_ms": 4.0,
    "p50_itl_ms": 21.7,
    "p90_itl_ms": 30.2,
}


@pytest.fixture
def options():
    """serve_bench.py's arguments at their defaults, on the qwen3-8b setup."""
    import argparse

    return argparse.Namespace(
        max_concurrency=256,
        seconds=30.0,
        min_prompts=32,
        input_len=128,
        output_len=128,
        temperature=0.0,
        seed=0,
        max_num_seqs=256,
        max_model_len=2048,
        graphs_to=2048,
        acceptance_rates="0.8,0.62,0.48,0.37,0.28,0.21,0.16",
        setup="qwen3-8b",
    )


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory):
    return shape_models("qwen3-8b", tmp_path_factory.mktemp("shape"), 128, 128)


def test_shapes_keep_their_paths_from_run_to_run(tmp_path, monkeypatch):
    """vLLM keys its torch.compile cache by the model's and drafter's paths: the next run
    must write the same folders, or every start compiles again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = serve_bench.setup_models("qwen3-8b", 512, 256)
    second = serve_bench.setup_models("qwen3-8b", 512, 256)
    assert (first.target, first.dspark, first.dflash) == (
        second.target,
        second.dspark,
        second.dflash,
    )
    assert Path(first.target).is_relative_to(tmp_path)


def test_arms_default_to_what_the_setup_runs():
    assert parse_arms(",".join(SETUP_ARMS["qwen3-8b"]), "qwen3-8b") == list(ARM_PRESETS)
    assert parse_arms("nospec, sps", "embedded") == ["nospec", "sps"]
    with pytest.raises(ValueError, match="unknown arms"):
        parse_arms("nospec,k5", "qwen3-8b")
    # The embedded drafter drafts blocks of 7 and the pair has no DFlash drafter.
    with pytest.raises(ValueError, match="cannot run"):
        parse_arms("k3", "embedded")
    with pytest.raises(ValueError, match="cannot run"):
        parse_arms("dflash", "embedded")


def test_request_rates_are_finite_and_positive():
    assert parse_request_rates("1,4.5,64") == [1.0, 4.5, 64.0]
    for text in ("0,1", "inf", "-2"):
        with pytest.raises(ValueError):
            parse_request_rates(text)


def test_every_presets_plugin_options_are_valid():
    for name, arm in ARM_PRESETS.items():
        options = arm.options or {}
        resolve_options({k: v for k, v in options.items() if k.startswith("dspark_")}, {})
        assert arm.num_drafts in (1, 3, 7), name


def parse_serve(model: str, words: list[str]):
    """`vllm serve model words...` through vLLM's own argument parser."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args([model, *words])


def test_the_sps_arm_serves_the_shape_with_calibrated_synthetic_confidence(qwen3_models, options):
    words = server_args(ARM_PRESETS["sps"], qwen3_models, options)
    parsed = parse_serve(qwen3_models.target, words)
    assert parsed.load_format == "dummy"
    # One extension: it finishes dummy DeepSeek-V4 weights and carries the counters' calls.
    assert parsed.worker_extension_cls == "vllm_dspark.bench.dummy_weights.DummyWeightsExtension"
    assert parsed.enable_prefix_caching is False
    assert parsed.max_num_seqs == 256 and parsed.max_model_len == 2048
    assert max(parsed.compilation_config.cudagraph_capture_sizes) == 2048
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 7
    assert spec["model"] == qwen3_models.dspark[7]
    assert spec["dspark_capacity"] == "sps" and spec["dspark_plain_steps"] is True
    assert spec["dspark_dynamic_depth"] is True and spec["dspark_varlen_verify"] is True
    # Conditional rates of the default profile: 0.8, then 0.62 / 0.8, ...
    assert spec["dspark_synthetic_confidence"][:2] == pytest.approx([0.8, 0.775])
    assert "rejection_sample_method" not in spec


def test_fixed_k_arms_draft_with_a_drafter_of_their_block(qwen3_models, options):
    for name, k in (("k1", 1), ("k3", 3), ("k7", 7)):
        words = server_args(ARM_PRESETS[name], qwen3_models, options)
        spec = json.loads(words[words.index("--speculative-config") + 1])
        assert spec["num_speculative_tokens"] == k
        assert json.loads((Path(spec["model"]) / "config.json").read_text())["block_size"] == k
        assert not any(key.startswith("dspark_capacity") for key in spec)
        assert len(spec["dspark_synthetic_confidence"]) == k


def test_the_dflash_arm_runs_its_controller_on_vllms_synthetic_rates(qwen3_models, options):
    words = server_args(ARM_PRESETS["dflash"], qwen3_models, options)
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec["method"] == "dflash" and spec["model"] == qwen3_models.dflash
    assert spec["dspark_capacity"] == "acceptance"
    assert spec["rejection_sample_method"] == "synthetic"
    assert spec["synthetic_acceptance_rates"][0] == pytest.approx(0.8)


def test_dynamic_sd_runs_vllms_batch_size_table(qwen3_models, options):
    words = server_args(ARM_PRESETS["dynamic-sd"], qwen3_models, options)
    spec = json.loads(words[words.index("--speculative-config") + 1])
    table = spec["num_speculative_tokens_per_batch_size"]
    assert table and all(len(entry) == 3 for entry in table)
    assert spec["num_speculative_tokens"] == 7


def test_no_speculation_and_the_embedded_pair(tmp_path, options):
    models = embedded_models(tmp_path, 64)
    assert "--speculative-config" not in server_args(ARM_PRESETS["nospec"], models, options)
    words = server_args(ARM_PRESETS["k7"], models, options)
    assert "--load-format" not in words  # real weights
    assert words[words.index("--worker-extension-cls") + 1] == "vllm_dspark.metrics.ServedCounters"
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {
        "method": "dspark",
        "model": str(EMBEDDED_PAIR / "draft"),
        "num_speculative_tokens": 7,
    }
    # The held-out prompts' text, one JSON line each, for vLLM's custom dataset.
    dataset = Path(models.dataset_args[models.dataset_args.index("--dataset-path") + 1])
    lines = dataset.read_text().splitlines()
    heldout = json.loads((EMBEDDED_PAIR / "heldout_prompts.json").read_text())
    assert [json.loads(line)["prompt"] for line in lines] == [p["text"] for p in heldout]


def parse_bench(command: list[str]):
    """`vllm bench serve`'s arguments through its own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert command[:3] == ["vllm", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(command[3:])


def test_a_poisson_point_and_the_saturating_point(qwen3_models, options, tmp_path):
    url = "http://127.0.0.1:8123"
    poisson = parse_bench(bench_command(url, qwen3_models, 16.0, 480, tmp_path, "a.json", options))
    assert poisson.base_url == url and poisson.model == qwen3_models.target
    assert poisson.dataset_name == "random"
    assert poisson.random_input_len == 128 and poisson.random_output_len == 128
    assert poisson.num_prompts == 480 and poisson.request_rate == 16.0
    assert poisson.max_concurrency is None and poisson.burstiness == 1.0  # Poisson
    assert poisson.ignore_eos and poisson.temperature == 0.0
    assert poisson.percentile_metrics == "ttft,tpot,itl"
    assert poisson.metric_percentiles == "50,90"
    assert poisson.save_result and poisson.result_dir == str(tmp_path)
    assert poisson.result_filename == "a.json"
    saturating = parse_bench(
        bench_command(url, qwen3_models, float("inf"), 1024, tmp_path, "b.json", options)
    )
    assert saturating.request_rate == float("inf") and saturating.max_concurrency == 256


class StreamingCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions as `vllm serve` streams it: a chunk per token, then the usage."""

    protocol_version = "HTTP/1.0"  # the body ends where the connection closes
    tokens = 4

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["stream"] and request["max_tokens"] == 128
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"text": " w"}]}] * self.tokens
        chunks.append({"choices": [], "usage": {"completion_tokens": self.tokens}})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_each_point_runs_vllms_client_in_this_process(qwen3_models, options, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StreamingCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    command = bench_command(url, qwen3_models, 8.0, 6, tmp_path, "p.json", options)
    log = io.StringIO()
    try:
        serve_bench.bench_serve(command, log)
    finally:
        server.shutdown()
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 4
    assert result["request_rate"] == 8.0
    assert log.getvalue().startswith("$ vllm bench serve --backend vllm")
    assert "Serving Benchmark Result" in log.getvalue()  # the client's printout, kept
    # A client that cannot run (a dataset file that does not exist) fails the point.
    broken = [*command, "--dataset-name", "custom", "--dataset-path", str(tmp_path / "none")]
    with pytest.raises(RuntimeError, match="vllm bench serve failed"):
        serve_bench.bench_serve(broken, io.StringIO())


def test_the_embedded_client_reads_the_held_out_text(tmp_path, options):
    models = embedded_models(tmp_path, 64)
    parsed = parse_bench(bench_command("http://x", models, 4.0, 120, tmp_path, "c.json", options))
    assert parsed.dataset_name == "custom" and parsed.custom_output_len == 64
    assert parsed.skip_chat_template
    assert parsed.dataset_path == str(tmp_path / "heldout_prompts.jsonl")


def test_points_are_sized_by_rate_and_concurrency(options):
    assert serve_bench.num_prompts(16.0, options) == 480
    assert serve_bench.num_prompts(0.5, options) == 32  # at least --min-prompts
    assert serve_bench.num_prompts(float("inf"), options) == 4 * 256


def test_spec_decode_counters_are_summed_over_engines_and_positions():
    counts = spec_decode_counts(METRICS)
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (120, 360, 180)
    assert counts.accepted_per_position == [96, 60, 24]
    before = spec_decode_counts(METRICS.replace("} 100.0", "} 40.0").replace("} 150.0", "} 60.0"))
    point = counts - before
    assert point.drafts == 60 and point.accepted_tokens == 90
    assert point.acceptance_length == pytest.approx(2.5)


def test_a_server_without_speculation_counts_nothing():
    counts = spec_decode_counts(METRICS.split("# HELP vllm:spec_decode")[0])
    assert counts.drafts == 0 and counts.accepted_per_position == []


def test_a_row_reads_vllms_result_and_the_points_counters():
    counts = spec_decode_counts(METRICS)
    row = point_row("qwen3-8b", "sps", RESULT, counts)
    assert row["setup"] == "qwen3-8b" and row["arm"] == "sps"
    assert row["request_rate"] == 16.0 and row["completed"] == 480
    assert row["output_tok_s"] == 1969.2
    assert (row["tpot_p50_ms"], row["tpot_p90_ms"]) == (6.05, 7.441)
    assert row["ttft_p50_ms"] == 38.4
    assert row["acceptance_length"] == 2.5  # 1 + 180 / 120
    assert row["verified_per_step"] == 3.0
    assert row["accepted_per_position"] == [0.8, 0.5, 0.2]
    saturating = point_row(
        "qwen3-8b", "nospec", RESULT | {"request_rate": "inf"}, SpecDecodeCounts()
    )
    assert saturating["request_rate"] == "inf" and saturating["acceptance_length"] is None


def sample_rows() -> list[dict]:
    rows = []
    for arm, speed in (("nospec", 1.0), ("k7", 2.5)):
        for rate, load in ((1.0, 1), (16.0, 12), ("inf", 200)):
            rows.append(
                {
                    "setup": "qwen3-8b",
                    "arm": arm,
                    "request_rate": rate,
                    "output_tok_s": 100.0 * load * speed,
                    "tpot_p50_ms": 7.0 / speed + load / 20,
                    "tpot_p90_ms": 9.0 / speed + load / 10,
                    "ttft_p50_ms": 30.0 + load,
                }
            )
    return rows


def test_the_plot_is_written(tmp_path):
    path = tmp_path / "serving.png"
    serve_bench.plot(sample_rows(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_a_merge_keeps_every_earlier_row_under_its_run(tmp_path):
    earlier = tmp_path / "serving.json"
    other = dict(sample_rows()[0], setup="embedded")
    provenance = {"command": "c", "commit": "abc", "date": "d1", "device": "H100"}
    earlier.write_text(json.dumps(provenance | {"rows": [*sample_rows(), other]}))
    rows, runs = earlier_record(earlier)
    # A record written before rows named their run is one run, its own provenance.
    assert runs == [provenance] and len(rows) == 7
    assert all(row["run"] == "d1" for row in rows)
    assert earlier_record(tmp_path / "missing.json") == ([], [])


def test_a_plot_tells_an_arm_measured_in_two_runs_apart(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, *a, **kw: labels.append(kw.get("label")) or plot(self, *a, **kw),
    )
    rows = [row | {"run": "d1"} for row in sample_rows()]
    rows += [row | {"run": "d2"} for row in sample_rows() if row["arm"] == "k7"]
    serve_bench.plot(rows, tmp_path / "serving.png")
    assert set(labels) - {None} == {"nospec", "k7 (run 1)", "k7 (run 2)"}


def test_the_tokenizer_gives_every_id_a_word_of_its_own(tmp_path):
    from vllm.tokenizers import get_tokenizer

    vocab = 300
    write_tokenizer(tmp_path, vocab)
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == vocab
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    words = [tokenizer.decode([i]) for i in range(vocab)]
    assert len(set(words)) == vocab
    ordinary = list(range(3, vocab))
    # What vLLM's random dataset does with its ids: decode, then encode back.
    text = tokenizer.decode(ordinary[::-1] + ordinary)
    assert tokenizer(text, add_special_tokens=False).input_ids == ordinary[::-1] + ordinary
    assert tokenizer.num_special_tokens_to_add() == 0


def test_the_shapes_tokenizer_covers_its_vocabulary(qwen3_models):
    config = json.loads((Path(qwen3_models.target) / "config.json").read_text())
    tokenizer = json.loads((Path(qwen3_models.target) / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == config["vocab_size"] == 151936
    assert tokenizer["model"]["vocab"]["</s>"] == config["eos_token_id"]


class LaterClock(datetime.datetime):
    """A clock a day ahead: a second run's date differs from the first's."""

    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + datetime.timedelta(days=1)


def test_a_run_records_every_point_and_the_arm_that_failed(tmp_path, monkeypatch):
    """main with fake servers and clients: one row per point of each arm that started, the
    failed arm named, provenance on top, the plot beside."""
    import serving

    started = []

    @contextlib.contextmanager
    def fake_server(model, words, env=None, log_path=None):
        speculative = (
            words[words.index("--speculative-config") + 1]
            if ("--speculative-config" in words)
            else None
        )
        # A speculating arm's server serves the plugin's counters (dev mode).
        assert (env == {"VLLM_SERVER_DEV_MODE": "1"}) == (speculative is not None)
        assert ("--worker-extension-cls" in words) == (speculative is not None)
        if speculative and "sps" in speculative:
            raise RuntimeError("vllm serve exited with 1; see log")
        started.append(model)
        yield "http://127.0.0.1:1"

    def fake_point(url, command, result_path, log, speculating):
        rate = command[command.index("--request-rate") + 1]
        result = RESULT | {"request_rate": rate if rate == "inf" else float(rate)}
        admission = AdmissionCounts(proposed=70, admitted=35, num_drafts=7, steps=10)
        return result, spec_decode_counts(METRICS), admission if speculating else None

    monkeypatch.setattr(serving, "vllm_server", fake_server)
    monkeypatch.setattr(serve_bench, "run_point", fake_point)
    monkeypatch.setenv("DSPARK_COMMIT", "abc1234")
    out = tmp_path / "serving.json"
    argv = ["serve_bench.py", "--setup", "embedded", "--arms", "nospec,k7,sps"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rates", "1,8", "--out", str(out)])
    assert serve_bench.main() == 1
    record = json.loads(out.read_text())
    assert record["commit"] == "abc1234" and record["setup"] == "embedded"
    assert {"command", "date", "device"} <= set(record)
    assert [(r["arm"], r["request_rate"]) for r in record["rows"]] == [
        (arm, rate) for arm in ("nospec", "k7") for rate in (1.0, 8.0, "inf")
    ]
    assert list(record["failed"]) == ["sps"]
    for row in record["rows"]:
        plugin = row.get("plugin")
        assert (plugin is not None) == (row["arm"] == "k7")
        if plugin:
            assert plugin["compacted_steps"] == 10
            assert plugin["verified_per_compacted_step"] == 3.5
    assert out.with_suffix(".png").exists()
    assert started == [str(EMBEDDED_PAIR / "target")] * 2
    assert [run["commit"] for run in record["runs"]] == ["abc1234"]
    assert {row["run"] for row in record["rows"]} == {record["date"]}
    # The next part merges it: every earlier row stays, k7 again beside it under a new run.
    monkeypatch.setenv("DSPARK_COMMIT", "def5678")
    part = tmp_path / "part2.json"
    argv = ["serve_bench.py", "--setup", "embedded", "--arms", "k7", "--merge", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--rates", "1,8", "--out", str(part)])
    monkeypatch.setattr(serve_bench.datetime, "datetime", LaterClock)
    assert serve_bench.main() == 0
    merged = json.loads(part.read_text())
    assert [run["commit"] for run in merged["runs"]] == ["abc1234", "def5678"]
    assert merged["commit"] == "def5678" and len(merged["rows"]) == 9
    assert [row["run"] for row in merged["rows"]].count(merged["date"]) == 3


def test_served_counters_read_the_plugin_in_the_worker(plugin_speculator):
    """The worker extension's methods run with the worker as ``self``: the controller's
    counters, and an empty gate reading without a draft gate."""
    from types import SimpleNamespace

    from vllm_dspark.metrics import ServedCounters

    speculator = plugin_speculator(7, dspark_capacity="budget")
    speculator.controller.compacted_steps, speculator.controller.drafts_admitted = 4, 9
    worker = SimpleNamespace(model_runner=SimpleNamespace(speculator=speculator))
    counts = AdmissionCounts(**ServedCounters.dspark_admission_counts(worker))
    assert (counts.steps, counts.admitted, counts.num_drafts) == (4, 9, 7)
    assert ServedCounters.dspark_gate_inputs(worker) == {}


def test_collective_rpc_posts_the_method_and_returns_each_ranks_result():
    import http.server
    import threading

    from serving import collective_rpc

    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(
                (self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            )
            body = json.dumps({"results": [{"steps": 1}, {"steps": 1}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert collective_rpc(url, "dspark_admission_counts") == [{"steps": 1}, {"steps": 1}]
    finally:
        server.shutdown()
    assert received == [("/collective_rpc", {"method": "dspark_admission_counts"})]


def test_a_points_plugin_counts_are_differences_and_its_fitted_costs_the_end_values():
    """Counters count over the point (after minus before); the step-overhead fit's O, a and
    b are what it had fitted by the point's end."""
    from vllm_dspark.metrics import AdmissionCounts

    before = AdmissionCounts(proposed=700, admitted=350, num_drafts=7, steps=10)
    before.per_request_overhead_us = 20.0
    after = AdmissionCounts(proposed=2100, admitted=750, num_drafts=7, steps=30)
    after.step_overhead_ms, after.per_request_overhead_us = 0.5, 60.0
    counts = serve_bench.plugin_counts(after - before)
    assert counts["compacted_steps"] == 20
    assert counts["verified_per_compacted_step"] == pytest.approx(400 / 200)
    assert (counts["step_overhead_ms"], counts["per_request_overhead_us"]) == (0.5, 60.0)
