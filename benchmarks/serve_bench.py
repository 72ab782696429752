"""Serving benchmark through vLLM's own client: latency against throughput, per arm.

    python benchmarks/serve_bench.py --setup qwen3-8b --arms nospec,k7,sps,dflash \
        --out benchmarks/results/serving_qwen3-8b.json

For each arm (a named preset, ``ARM_PRESETS``) it starts `vllm serve` on loopback (the
plugin loads itself, as a general plugin) with the arm's ``--speculative-config``, waits
for ``/health``, warms the server up once at the saturating load (unrecorded), then runs
`vllm bench serve` (vLLM 0.26.0's own client: its parser and ``main``, called in this
process, which spares each point a new interpreter's ~15 s of imports) once per load:
Poisson arrivals at each of ``--rates`` requests per second, then every request at once
(``--request-rate inf``) with at most ``--max-concurrency`` in flight. Each point keeps
the client's own result JSON (under ``<out stem>_points/``) and scrapes ``/metrics``
before and after it for vLLM's spec-decode counters (acceptance length, accepted share per
position); a speculating arm's server also runs the plugin's worker extension
(``vllm_dspark.metrics.ServedCounters``, vLLM's dev-mode ``/collective_rpc``), read
around each point for what capacity control decided there (``plugin``: compacted and mixed
steps, drafts verified per request, proposals skipped or rested). Then the server stops,
even on failure; an arm whose server fails is recorded and the others still run.

The record (``--out``) holds the provenance (command, commit, date, device) and one row
per point: {setup, arm, request_rate, output_tok_s, tpot_p50_ms, tpot_p90_ms,
ttft_p50_ms, acceptance_length, run, ...}; it is rewritten after every point. ``run`` is
the date of the run that measured the row. ``--merge`` keeps every row of an earlier
record, whose ``runs`` (each run's command, commit, date and device) the new record
extends: a table too long for one session grows part by part, each part running no
speculation and k=7 again, so that its ratios come from one run
(``tools/targets_summary.py serving`` bridges parts through them). The PNG beside it plots
the setup's TPOT (p50 solid, p90 dashed) and TTFT (p50) against output throughput, one
curve per arm and run.

Setups:
- ``embedded``: the trained pair (real weights and tokenizer), prompts its held-out text
  (vLLM's ``custom`` dataset, no chat template). Its drafter is DSpark with a block of 7
  and no DFlash drafter: the k1, k3 and dflash arms need ``qwen3-8b``.
- ``qwen3-8b``: that shape with dummy weights (``shapes.py``), DSpark drafts accepted
  with calibrated synthetic confidence and DFlash's with vLLM's synthetic per-position
  rates (``offline_sweep.speculative_config``), prompts vLLM's ``random`` dataset. `vllm
  bench serve` needs a tokenizer for text prompts: a word-level one written beside the
  target (:func:`write_tokenizer`) gives every token id a word of its own, so the
  client's random ids survive its decode and re-encode exactly. Requests carry no seed:
  synthetic acceptance draws differ between arms (the offline sweep's common random
  numbers need a seed per request).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from offline_sweep import (
    ARMS,
    DEFAULT_RATES,
    DFLASH_DEPTH_PLAIN,
    SPS_DEPTH_PLAIN,
    capture_sizes,
    speculative_config,
)
from shapes import SHAPES, shape_root, write_shape

from vllm_dspark.bench import DUMMY_WEIGHTS_EXTENSION
from vllm_dspark.metrics import PREFIX, AdmissionCounts, SpecDecodeCounts


@dataclass(frozen=True)
class Arm:
    """A preset: the arm's speculative options as offline_sweep.py writes them (None: no
    speculation; ``method`` picks DFlash) and its number of drafts K."""

    options: dict | None
    num_drafts: int = 7


ARM_PRESETS = {
    "nospec": Arm(None),
    # Stock DSpark, fixed K (no plugin option set: the plugin stays inert).
    "k1": Arm(ARMS["dspark"], 1),
    "k3": Arm(ARMS["dspark"], 3),
    "k7": Arm(ARMS["dspark"], 7),
    # vLLM's Dynamic SD: K by batch size from the table tune_dynamic_sd.py derived.
    "dynamic-sd": Arm(ARMS["dynamic-sd"]),
    # README, "Which to set": sps with compact verification, plain steps and dynamic depth.
    "sps": Arm(SPS_DEPTH_PLAIN),
    # DFlash with its acceptance-length controller, the same two (README, "DFlash's
    # acceptance controller").
    "dflash": Arm(DFLASH_DEPTH_PLAIN),
}
# The embedded pair's drafter drafts blocks of 7 (offline_sweep.py refuses other K there
# too) and it has no DFlash drafter.
SETUP_ARMS = {
    "embedded": ["nospec", "k7", "dynamic-sd", "sps"],
    "qwen3-8b": list(ARM_PRESETS),
}
# Light load to about no speculation's saturation on the Qwen3-8B shape (~34 requests/s at
# 512 + 256 tokens on an H100); the `inf` point saturates every arm.
DEFAULT_REQUEST_RATES = "1,4,16,32"
# What names a run in a record's ``runs`` (a row's ``run`` is its date).
RUN_KEYS = ("command", "commit", "date", "device")
# The plugin's counters in a served engine (read through /collective_rpc in dev mode).
SERVED_COUNTERS = "vllm_dspark.metrics.ServedCounters"


def parse_arms(text: str, setup: str) -> list[str]:
    """Comma-separated preset names, each one this setup can run."""
    arms = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in arms if name not in ARM_PRESETS]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; presets: {', '.join(ARM_PRESETS)}")
    unsupported = [name for name in arms if name not in SETUP_ARMS[setup]]
    if unsupported:
        raise ValueError(
            f"setup {setup} cannot run {unsupported}; it runs {', '.join(SETUP_ARMS[setup])}"
        )
    return arms


def parse_request_rates(text: str) -> list[float]:
    """Comma-separated requests per second, each finite and positive (the saturating point,
    every request at once, is always added: ``--max-concurrency``)."""
    rates = [float(rate) for rate in text.split(",")]
    if not all(0 < rate < float("inf") for rate in rates):
        raise ValueError(f"request rates must be finite and positive: {text}")
    return rates


def write_tokenizer(folder: Path, vocab_size: int, bos_id: int = 1, eos_id: int = 2) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (tokenizer.json and
    tokenizer_config.json in ``folder``): id i is the word ``t<i>``, words split at
    whitespace, so any id sequence decodes to text that encodes back to it. Ids 0, bos_id
    and eos_id are the unknown, begin and end tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {0: "<unk>", bos_id: "<s>", eos_id: "</s>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 1 << 20,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


@dataclass
class Models:
    """Where a setup's checkpoints are: the target, DSpark drafters by K, the DFlash
    drafter (None: none), whether the weights are dummy, and the client's dataset flags."""

    target: str
    dspark: dict[int, str]
    dflash: str | None
    dummy: bool
    dataset_args: list[str]


def embedded_models(root: Path, output_len: int) -> Models:
    """The trained pair; its held-out prompts' text (64 tokens each) as a custom JSONL
    dataset under ``root``."""
    from vllm_dspark.demo import EMBEDDED_PAIR

    prompts = json.loads((EMBEDDED_PAIR / "heldout_prompts.json").read_text())
    dataset = root / "heldout_prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p["text"]}) + "\n" for p in prompts))
    return Models(
        target=str(EMBEDDED_PAIR / "target"),
        dspark={7: str(EMBEDDED_PAIR / "draft")},
        dflash=None,
        dummy=False,
        dataset_args=[
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset),
            "--custom-output-len",
            str(output_len),
            "--skip-chat-template",
        ],
    )


def shape_models(shape: str, root: Path, input_len: int, output_len: int) -> Models:
    """Config-only checkpoints of ``shape`` (``shapes.write_shape``): a DSpark drafter per
    K of the presets (each drafts a block of its K), the K=7 folder's DFlash drafter, and
    a word-level tokenizer beside the target."""
    drafts = sorted({arm.num_drafts for arm in ARM_PRESETS.values()})
    paths = {k: write_shape(shape, root / f"k{k}", block=k) for k in drafts}
    target = paths[7]["target"]
    write_tokenizer(Path(target), SHAPES[shape][-1])
    return Models(
        target=target,
        dspark={k: path["draft"] for k, path in paths.items()},
        dflash=paths[7]["dflash"],
        dummy=True,
        dataset_args=[
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(output_len),
        ],
    )


def setup_models(setup: str, input_len: int, output_len: int) -> Models:
    """``input_len``: the random prompts of a shape (the embedded pair's are its own).
    Written under ``shape_root``, a folder that keeps its path, so that vLLM's compile
    caches (keyed by the model's path) serve the next run too."""
    root = shape_root("serve") / setup
    root.mkdir(parents=True, exist_ok=True)
    if setup == "embedded":
        return embedded_models(root, output_len)
    return shape_models(setup, root, input_len, output_len)


def arm_speculative_config(arm: Arm, models: Models, acceptance_rates: str) -> dict | None:
    """The arm's ``--speculative-config`` (None: no speculation), built as the offline
    sweep builds its arms' (synthetic acceptance on dummy weights)."""
    if arm.options is None:
        return None
    spec = {
        "options": arm.options,
        "draft": models.dspark[arm.num_drafts],
        "dflash": models.dflash,
        "num_drafts": arm.num_drafts,
        "dummy": models.dummy,
        "rates": acceptance_rates,
        "acceptance": "confidence",
    }
    return speculative_config(spec)


def server_args(arm: Arm, models: Models, args: argparse.Namespace) -> list[str]:
    """`vllm serve`'s arguments after the model: the same engine for every arm (bf16,
    CUDA graphs up to ``--graphs-to`` tokens, no prefix caching, as the offline sweep's
    engines), then the arm's speculative config."""
    words = [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--compilation-config",
        json.dumps({"cudagraph_capture_sizes": capture_sizes(args.graphs_to)}),
    ]
    if models.dummy:
        words += ["--load-format", "dummy", "--worker-extension-cls", DUMMY_WEIGHTS_EXTENSION]
    speculative = arm_speculative_config(arm, models, args.acceptance_rates)
    if speculative is not None:
        words += ["--speculative-config", json.dumps(speculative)]
        if not models.dummy:  # the dummy-weights extension carries the counters' calls
            words += ["--worker-extension-cls", SERVED_COUNTERS]
    return words


def num_prompts(rate: float, args: argparse.Namespace) -> int:
    """Requests of one point: ``--seconds`` of arrivals at a finite rate (at least
    ``--min-prompts``), or four waves of ``--max-concurrency`` at once."""
    if rate == float("inf"):
        return 4 * args.max_concurrency
    return max(args.min_prompts, round(rate * args.seconds))


def bench_command(
    base_url: str,
    models: Models,
    rate: float,
    prompts: int,
    result_dir: Path,
    result_filename: str,
    args: argparse.Namespace,
) -> list[str]:
    """`vllm bench serve` for one point: ``prompts`` requests of ``--output-len`` tokens
    (EOS ignored) arriving at ``rate`` per second (Poisson; inf: all at once, at most
    ``--max-concurrency`` in flight), greedy unless ``--temperature``; vLLM's result JSON
    saved as ``result_dir/result_filename`` with TTFT, TPOT and ITL at p50 and p90."""
    command = [
        "vllm",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        models.target,
        *models.dataset_args,
        "--num-prompts",
        str(prompts),
        "--request-rate",
        "inf" if rate == float("inf") else f"{rate:g}",
        "--temperature",
        f"{args.temperature:g}",
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        "--disable-tqdm",
    ]
    if rate == float("inf"):
        command += ["--max-concurrency", str(args.max_concurrency)]
    return command


def spec_decode_counts(prometheus_text: str) -> SpecDecodeCounts:
    """vLLM's spec-decode counters in a ``/metrics`` page, summed over engines (per
    position, by the ``position`` label). Zero without speculation."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = SpecDecodeCounts()
    totals = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens"}
    totals["num_accepted_tokens"] = "accepted_tokens"
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(prometheus_text):
        name = family.name.removeprefix(PREFIX)
        if not family.name.startswith(PREFIX):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the counters' _created timestamps
            if name in totals:
                setattr(counts, totals[name], getattr(counts, totals[name]) + sample.value)
            elif name == "num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    counts.accepted_per_position = [per_position.get(i, 0.0) for i in range(len(per_position))]
    return counts


def plugin_counts(admission: AdmissionCounts) -> dict:
    """What capacity control decided over a point (``admission``: after minus before)."""
    return {
        "compacted_steps": admission.steps,
        "mixed_steps": admission.mixed_steps,
        "graph_steps": admission.graph_steps,
        "verified_per_compacted_step": round(admission.admitted_per_request, 3)
        if admission.steps
        else None,
        "proposals_skipped": admission.proposals_skipped,
        "proposals_rested": admission.proposals_rested,
        "step_overhead_ms": admission.step_overhead_ms,
        "per_request_overhead_us": admission.per_request_overhead_us,
        "per_draft_overhead_us": admission.per_draft_overhead_us,
        "plain_step_ms": admission.plain_step_ms,
    }


def point_row(
    setup: str,
    arm: str,
    result: dict,
    counts: SpecDecodeCounts,
    admission: AdmissionCounts | None = None,
) -> dict:
    """One point's row from `vllm bench serve`'s result JSON and the counters over the
    point (after minus before): vLLM's spec-decode ``counts`` and the plugin's
    ``admission`` (None: not read, no speculation)."""
    rate = result["request_rate"]
    plugin = {"plugin": plugin_counts(admission)} if admission is not None else {}
    return plugin | {
        "setup": setup,
        "arm": arm,
        "request_rate": rate if rate == "inf" else float(rate),
        "max_concurrency": result.get("max_concurrency"),
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "output_tok_s": round(result["output_throughput"], 1),
        "tpot_p50_ms": round(result["p50_tpot_ms"], 3),
        "tpot_p90_ms": round(result["p90_tpot_ms"], 3),
        "ttft_p50_ms": round(result["p50_ttft_ms"], 2),
        "ttft_p90_ms": round(result["p90_ttft_ms"], 2),
        "itl_p50_ms": round(result["p50_itl_ms"], 3),
        "acceptance_length": round(counts.acceptance_length, 3) if counts.drafts else None,
        # Drafts verified per request and step (capacity control verifies fewer than K).
        "verified_per_step": round(counts.draft_tokens / counts.drafts, 3)
        if counts.drafts
        else None,
        "accepted_per_position": [round(a, 4) for a in counts.per_position_acceptance]
        if counts.drafts
        else None,
        "duration_s": round(result["duration"], 2),
    }


def plot(rows: list[dict], path: Path) -> None:
    """TPOT (p50 solid, p90 dashed) and TTFT (p50) against output tokens per second, one
    colour per arm and run (an arm measured in several runs is labelled by run), the
    points in order of load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    fig, (tpot, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = list(dict.fromkeys((row["arm"], row.get("run")) for row in rows))
    runs = list(dict.fromkeys(run for _, run in curves))
    for index, (arm, run) in enumerate(curves):
        points = [row for row in rows if (row["arm"], row.get("run")) == (arm, run)]
        points.sort(key=lambda row: float(row["request_rate"]))
        throughput = [row["output_tok_s"] for row in points]
        colour = f"C{index % 10}"
        repeated = sum(a == arm for a, _ in curves) > 1
        label = f"{arm} (run {runs.index(run) + 1})" if repeated else arm
        tpot.plot(throughput, [r["tpot_p50_ms"] for r in points], "o-", color=colour, label=label)
        tpot.plot(throughput, [r["tpot_p90_ms"] for r in points], "o--", color=colour, alpha=0.6)
        ttft.plot(throughput, [r["ttft_p50_ms"] for r in points], "o-", color=colour, label=label)
    setups = ", ".join(dict.fromkeys(row["setup"] for row in rows))
    tpot.set_title(f"{setups}: TPOT (p50 solid, p90 dashed)", fontsize=9)
    ttft.set_title(f"{setups}: TTFT p50", fontsize=9)
    for axis, label in ((tpot, "time per output token (ms)"), (ttft, "time to first token (ms)")):
        axis.set_xlabel("output tokens / s")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        # Plain milliseconds at 1, 2 and 5 of each decade (not powers of ten).
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.grid(alpha=0.3)
    tpot.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit() -> str:
    """DSPARK_COMMIT (the device machine's copy has no git history), else ``git rev-parse``."""
    if os.environ.get("DSPARK_COMMIT"):
        return os.environ["DSPARK_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    """The GPU's name from nvidia-smi (the driver process leaves CUDA to the servers)."""
    if shutil.which("nvidia-smi"):
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip().splitlines()[0]
    return "no GPU found"


def write_record(path: Path, provenance: dict, rows: list[dict], failed: dict) -> None:
    """The record so far (whole or not at all), and the plot of its setup's rows."""
    record = provenance | {"rows": rows, **({"failed": failed} if failed else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)
    setup_rows = [row for row in rows if row["setup"] == provenance["setup"]]
    if setup_rows:
        plot(setup_rows, path.with_suffix(".png"))


def earlier_record(path: Path | None) -> tuple[list[dict], list[dict]]:
    """An earlier record's rows and runs (a record written before rows named their run:
    one run, its own provenance), or nothing where there is none."""
    if path is None or not path.exists():
        return [], []
    record = json.loads(path.read_text())
    own = {key: record.get(key) for key in RUN_KEYS}
    rows = [{"run": own["date"]} | row for row in record["rows"]]
    return rows, record.get("runs", [own])


def served_admission(url: str) -> AdmissionCounts:
    """The first rank's plugin counters (ranks admit alike)."""
    from serving import collective_rpc

    return AdmissionCounts(**collective_rpc(url, "dspark_admission_counts")[0])


def bench_serve(command: list[str], log) -> None:
    """Run ``command`` (``vllm bench serve ARGS``) in this process through vLLM's own
    parser and ``main``, its printout into ``log``. A client that fails raises
    RuntimeError, as a failed arm's server does."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(command[3:])
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            main(args)
    except Exception as error:
        raise RuntimeError(f"vllm bench serve failed: {error!r}") from error
    finally:
        log.flush()


def run_point(
    url: str, command: list[str], result_path: Path, log, speculating: bool
) -> tuple[dict, SpecDecodeCounts, AdmissionCounts | None]:
    """One `vllm bench serve` run between two readings of the server's counters (the
    plugin's too where ``speculating``)."""
    from serving import scrape_metrics

    before = spec_decode_counts(scrape_metrics(url))
    admitted_before = served_admission(url) if speculating else None
    bench_serve(command, log)
    after = spec_decode_counts(scrape_metrics(url))
    admission = served_admission(url) - admitted_before if speculating else None
    return json.loads(result_path.read_text()), after - before, admission


def run_arm(name: str, models: Models, args, points_dir: Path, keep) -> None:
    """One arm's server, warm-up and points; each row goes to ``keep``."""
    from serving import vllm_server
    from tqdm import tqdm

    arm = ARM_PRESETS[name]
    log_path = points_dir / f"{name}.server.log"
    rates = [*args.request_rates, float("inf")]
    speculating = arm.options is not None
    # Dev mode serves /collective_rpc, through which the plugin's counters are read.
    env = {"VLLM_SERVER_DEV_MODE": "1"} if speculating else None
    words = server_args(arm, models, args)
    with (
        vllm_server(models.target, words, env=env, log_path=log_path) as url,
        open(points_dir / f"{name}.client.log", "w") as log,
    ):
        warm = bench_command(
            url, models, float("inf"), args.max_concurrency, points_dir, "warmup.json", args
        )
        run_point(url, warm, points_dir / "warmup.json", log, speculating)
        for rate in tqdm(rates, desc=name, unit="point"):
            filename = f"{name}_rate_{rate:g}.json"
            command = bench_command(
                url, models, rate, num_prompts(rate, args), points_dir, filename, args
            )
            result, counts, admission = run_point(
                url, command, points_dir / filename, log, speculating
            )
            row = point_row(args.setup, name, result, counts, admission)
            keep(row | {"result_file": filename})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", default="embedded", choices=list(SETUP_ARMS))
    parser.add_argument("--arms", help="comma-separated presets (default: all the setup runs)")
    parser.add_argument(
        "--rates",
        default=DEFAULT_REQUEST_RATES,
        help="Poisson request rates per second, light load to saturation; a point with "
        "every request at once (--max-concurrency) follows",
    )
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="arrivals per finite-rate point"
    )
    parser.add_argument("--min-prompts", type=int, default=32)
    # 512-token prompts and 256 output tokens, the setup served comparisons use.
    parser.add_argument("--input-len", type=int, default=512, help="random prompts (qwen3-8b)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="the client's dataset seed")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--graphs-to", type=int, default=2048, help="CUDA graphs up to this many tokens"
    )
    parser.add_argument(
        "--acceptance-rates",
        default=DEFAULT_RATES,
        help="qwen3-8b: unconditional acceptance per draft position (synthetic)",
    )
    parser.add_argument("--merge", type=Path, help="an earlier record: keep its rows and runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        arms = parse_arms(args.arms or ",".join(SETUP_ARMS[args.setup]), args.setup)
        args.request_rates = parse_request_rates(args.rates)
    except ValueError as error:
        parser.error(str(error))

    points_dir = args.out.with_name(f"{args.out.stem}_points")
    points_dir.mkdir(parents=True, exist_ok=True)
    run = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
    }
    rows, runs = earlier_record(args.merge)
    provenance = run | {
        "setup": args.setup,
        "arms": {name: ARM_PRESETS[name].options for name in arms},
        "runs": [*runs, run],
    }
    failed: dict[str, str] = {}

    def keep(row: dict) -> None:
        row["run"] = run["date"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_record(args.out, provenance, rows, failed)

    models = setup_models(args.setup, args.input_len, args.output_len)
    for name in arms:
        try:
            run_arm(name, models, args, points_dir, keep)
        except (RuntimeError, TimeoutError) as error:
            # The other arms still run; the logs under points_dir say why.
            failed[name] = str(error)
            print(f"{name} failed: {error}", file=sys.stderr, flush=True)
            write_record(args.out, provenance, rows, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
