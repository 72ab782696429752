"""Draft LM head on one GPU: bf16 cuBLAS against the rowwise-FP8 Triton kernels.

For each head shape (hidden x vocab) and row count m it times, as medians over CUDA-graph
replays (the drafter runs inside CUDA graphs; a graph of several back-to-back calls removes
launch gaps from every arm alike):

    bf16_ms              x @ W.T (cuBLAS)
    bf16_argmax_ms       x @ W.T, then torch.argmax
    scaled_mm_ms         rowwise FP8 through torch._scaled_mm, activation quantisation included
    fp8_ms               fp8_head_logits, bf16 logits
    fused_argmax_ms      fp8_head_argmax (no logits written)
    markov_*             the same with a rank-256 Markov bias: bf16 (x@W.T + e@W2.T).argmax
                         against the fused kernel with a bf16 and with an FP8 W2

plus eager medians (triton.testing.do_bench) of the two arms the targets compare, a
device-to-device copy measured in the same run, and each arm's bandwidth (weight + activation
bytes read, logits writes not counted) as a fraction of that copy's (read + write) bandwidth.
Data are random normal (weights std 0.02, activations std 1), never zeros. Unless --no-sweep,
every alternative of ``candidate_configs(m)`` is timed too; the JSON names the fastest.

    python benchmarks/bench_fp8_draft_head.py [--quick] [--no-sweep] [--out PATH]
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
from tqdm import tqdm

from vllm_dspark.head import fp8_head_kernel as kernels
from vllm_dspark.head.fp8_rowwise import E4M3_MAX, Fp8RowwiseWeight

SHAPES = ((4096, 151936), (7168, 129280))
ROWS = (1, 8, 32, 64, 256, 1792)
QUICK_SHAPES, QUICK_ROWS = SHAPES[:1], (1, 64, 1792)
MARKOV_RANK = 256
SMALL_ROWS, SMALL_SPEEDUP, SMALL_BW_FRAC = 64, 1.8, 0.8
LARGE_ROWS, LARGE_SPEEDUP = 1792, 1.6
REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda"


def graph_ms(fn, *, replays: int = 15, budget_ms: float = 6.0) -> dict:
    """Median (and range) of one call's time, from replays of a graph of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(64, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return {"ms": statistics.median(times), "min": min(times), "max": max(times)}


def eager_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbs() -> float:
    src = torch.randint(0, 256, (1 << 31,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), budget_ms=20.0)["ms"]
    return 2 * src.numel() / ms / 1e6


def scaled_mm_logits(x, w8_t, w_scale_row):
    """The measured baseline of shared/device/fp8_head_bench.py: torch ops quantise x."""
    a_scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / E4M3_MAX
    a8 = (x.float() / a_scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(
        a8, w8_t, scale_a=a_scale, scale_b=w_scale_row, out_dtype=torch.bfloat16
    )


class Point:
    """One (shape, m) measurement: arms are recorded; a failing arm records its error."""

    def __init__(self, hidden: int, vocab: int, m: int):
        self.row = {"hidden": hidden, "vocab": vocab, "m": m, "errors": {}}

    def time(self, name: str, fn, *, eager: bool = False) -> None:
        try:
            if eager:
                self.row[name] = eager_ms(fn)
            else:
                timing = graph_ms(fn)
                self.row[name] = timing["ms"]
                self.row[f"{name}_range"] = [timing["min"], timing["max"]]
        except Exception as error:  # keep measuring the other arms; the JSON says what broke
            self.row[name] = None
            self.row["errors"][name] = f"{type(error).__name__}: {error}"[:500]
            traceback.print_exc(file=sys.stderr)

    def record(self, name: str, compute) -> None:
        try:
            self.row[name] = compute()
        except Exception as error:
            self.row[name] = None
            self.row["errors"][name] = f"{type(error).__name__}: {error}"[:500]
            traceback.print_exc(file=sys.stderr)


class Arms:
    """The inputs of one (shape, m) point and the calls that the arms time."""

    def __init__(self, weight, head, w2, w2_fp8, m: int):
        g = torch.Generator(device=DEVICE).manual_seed(m)
        self.weight, self.head, self.w2, self.w2_fp8 = weight, head, w2, w2_fp8
        self.x = torch.randn(m, head.hidden, device=DEVICE, generator=g).bfloat16()
        self.e = torch.randn(m, MARKOV_RANK, device=DEVICE, generator=g).bfloat16()
        self.workspace = kernels.HeadWorkspace.allocate(m, head)
        self.index = torch.empty(m, dtype=torch.int64, device=DEVICE)
        self.value = torch.empty(m, device=DEVICE)
        self.logits = torch.empty(m, head.vocab, dtype=torch.bfloat16, device=DEVICE)
        self.w8_t, self.w_scale_row = head.weight.t(), head.scale[None, :]
        self.config = kernels.default_config(m)

    def bf16(self):
        return self.x @ self.weight.T

    def bf16_argmax(self):
        return torch.argmax(self.x @ self.weight.T, dim=-1)

    def bf16_markov_argmax(self):
        return torch.argmax((self.x @ self.weight.T).addmm_(self.e, self.w2.T), dim=-1)

    def scaled_mm(self):
        return scaled_mm_logits(self.x, self.w8_t, self.w_scale_row)

    def fp8_logits(self):
        return kernels.fp8_head_logits(self.x, self.head, out=self.logits, workspace=self.workspace)

    def fused(self, config=None, markov_weight=None):
        return kernels.fp8_head_argmax(
            self.x,
            self.head,
            markov_embed=None if markov_weight is None else self.e,
            markov_weight=markov_weight,
            out_index=self.index,
            out_value=self.value,
            workspace=self.workspace,
            config=config or self.default_for(markov_weight),
        )[0]

    def default_for(self, markov_weight) -> kernels.HeadTileConfig:
        # A fused Markov bias runs in the Triton tiles: the cuBLAS route has no epilogue.
        if markov_weight is None:
            return self.config
        return kernels.default_config(self.x.shape[0], cublas=False)

    def agreement(self, reference, **kw) -> float:
        self.index.fill_(-7)
        got = self.fused(**kw)
        if bool((got == -7).any()):
            raise RuntimeError("fused argmax left rows unwritten")
        return (got == reference).float().mean().item()


def time_arms(point: Point, arms: Arms, *, markov: bool) -> None:
    point.row["default_config"] = dataclasses.asdict(arms.config)
    point.time("bf16_ms", arms.bf16)
    point.time("bf16_argmax_ms", arms.bf16_argmax)
    point.time("scaled_mm_ms", arms.scaled_mm)
    point.time("fp8_ms", arms.fp8_logits)
    point.time("fused_argmax_ms", arms.fused)
    point.time("bf16_argmax_eager_ms", arms.bf16_argmax, eager=True)
    point.time("fused_argmax_eager_ms", arms.fused, eager=True)
    reference = arms.bf16_argmax()
    point.record("argmax_agreement", lambda: arms.agreement(reference))
    point.record(
        "fused_vs_scaled_mm_agreement", lambda: arms.agreement(arms.scaled_mm().argmax(-1))
    )
    if markov:
        point.time("markov_bf16_argmax_ms", arms.bf16_markov_argmax)
        point.time("markov_fused_ms", lambda: arms.fused(markov_weight=arms.w2))
        point.time("markov_fused_fp8_ms", lambda: arms.fused(markov_weight=arms.w2_fp8))
        markov_reference = arms.bf16_markov_argmax()
        point.record(
            "markov_argmax_agreement",
            lambda: arms.agreement(markov_reference, markov_weight=arms.w2),
        )


def sweep_configs(point: Point, arms: Arms) -> None:
    """Time every candidate tile config; a failing one records its error."""
    row = point.row
    default = {"config": row["default_config"], "ms": row["fused_argmax_ms"]}
    results = [dict(default, agreement=row["argmax_agreement"])]
    reference = arms.bf16_argmax()
    for config in kernels.candidate_configs(row["m"])[1:]:
        probe = Point(row["hidden"], row["vocab"], row["m"])
        probe.time("ms", lambda config=config: arms.fused(config))
        probe.record("agreement", lambda config=config: arms.agreement(reference, config=config))
        entry = {"config": dataclasses.asdict(config), "ms": probe.row["ms"]}
        entry["agreement"] = probe.row["agreement"]
        if probe.row["errors"]:
            entry["errors"] = probe.row["errors"]
        results.append(entry)
    row["sweep"] = results
    timed = [r for r in results if r["ms"] is not None]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        row["best_config"], row["best_fused_argmax_ms"] = best["config"], best["ms"]


def derive(row: dict, arms: Arms, copy_gbs: float) -> None:
    """Bandwidths (bytes read / time, as a fraction of the copy's) and speedups."""
    head, x = arms.head, arms.x
    fp8_bytes = head.weight.numel() + 4 * head.vocab + 2 * x.numel()
    bf16_bytes = 2 * arms.weight.numel() + 2 * x.numel()
    markov_bytes = 2 * arms.e.numel()

    def gbs(arm, nbytes):
        ms = row.get(arm)
        return None if ms is None else nbytes / ms / 1e6

    def frac(arm, nbytes):
        bw = gbs(arm, nbytes)
        return None if bw is None else bw / copy_gbs

    row["fused_bw_gbs"] = gbs("fused_argmax_ms", fp8_bytes)
    row["fused_bw_frac"] = frac("fused_argmax_ms", fp8_bytes)
    row["fused_eager_bw_frac"] = frac("fused_argmax_eager_ms", fp8_bytes)
    row["best_fused_bw_frac"] = frac("best_fused_argmax_ms", fp8_bytes)
    row["fp8_bw_frac"] = frac("fp8_ms", fp8_bytes)
    row["scaled_mm_bw_frac"] = frac("scaled_mm_ms", fp8_bytes)
    row["bf16_bw_frac"] = frac("bf16_ms", bf16_bytes)
    if "markov_fused_ms" in row:
        bf16_w2 = 2 * arms.w2.numel()
        fp8_w2 = arms.w2.numel() + 4 * head.vocab
        row["markov_fused_bw_frac"] = frac("markov_fused_ms", fp8_bytes + bf16_w2 + markov_bytes)
        row["markov_fused_fp8_bw_frac"] = frac(
            "markov_fused_fp8_ms", fp8_bytes + fp8_w2 + markov_bytes
        )
    for name, num, den in (
        ("fused_speedup", "bf16_argmax_ms", "fused_argmax_ms"),
        ("fused_eager_speedup", "bf16_argmax_eager_ms", "fused_argmax_eager_ms"),
        ("fp8_logits_speedup", "bf16_ms", "fp8_ms"),
        ("best_fused_speedup", "bf16_argmax_ms", "best_fused_argmax_ms"),
        ("markov_fused_speedup", "markov_bf16_argmax_ms", "markov_fused_ms"),
        ("markov_fused_fp8_speedup", "markov_bf16_argmax_ms", "markov_fused_fp8_ms"),
    ):
        if row.get(num) is not None and row.get(den) is not None:
            row[name] = row[num] / row[den]


def check_targets(rows: list[dict]) -> dict:
    def target(select, key, minimum):
        by_row = []
        for r in rows:
            if select(r["m"]):
                v = r.get(key)
                by_row.append(
                    {
                        "hidden": r["hidden"],
                        "vocab": r["vocab"],
                        "m": r["m"],
                        "value": v,
                        "pass": v is not None and v >= minimum,
                    }
                )
        return {
            "min": minimum,
            "pass": bool(by_row) and all(b["pass"] for b in by_row),
            "by_row": by_row,
        }

    small = lambda m: m <= SMALL_ROWS  # noqa: E731
    large = lambda m: m == LARGE_ROWS  # noqa: E731
    targets = {
        "fused_speedup_rows_le_64": target(small, "fused_speedup", SMALL_SPEEDUP),
        "fused_bw_frac_rows_le_64": target(small, "fused_bw_frac", SMALL_BW_FRAC),
        "fused_speedup_rows_1792": target(large, "fused_speedup", LARGE_SPEEDUP),
        "eager_fused_speedup_rows_le_64": target(small, "fused_eager_speedup", SMALL_SPEEDUP),
        "eager_fused_bw_frac_rows_le_64": target(small, "fused_eager_bw_frac", SMALL_BW_FRAC),
        "eager_fused_speedup_rows_1792": target(large, "fused_eager_speedup", LARGE_SPEEDUP),
        "best_config_speedup_rows_le_64": target(small, "best_fused_speedup", SMALL_SPEEDUP),
        "best_config_bw_frac_rows_le_64": target(small, "best_fused_bw_frac", SMALL_BW_FRAC),
        "best_config_speedup_rows_1792": target(large, "best_fused_speedup", LARGE_SPEEDUP),
    }
    primary = ("fused_speedup_rows_le_64", "fused_bw_frac_rows_le_64", "fused_speedup_rows_1792")
    targets["all_pass"] = all(targets[k]["pass"] for k in primary)
    return targets


def fmt(v, width=8, digits=3):
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def print_table(result: dict) -> None:
    print(f"\n{result['device']}   copy {result['copy_bandwidth_gbs']:.0f} GB/s")
    head = (
        f"{'H':>5} {'V':>7} {'m':>5} {'bf16':>8} {'bf16+am':>8} {'scaledmm':>8} {'fp8':>8} "
        f"{'fused':>8} {'x':>5} {'bw':>5} {'eager':>8} {'mk_bf16':>8} {'mk_fuse':>8} "
        f"{'agree':>6} {'best':>8} {'best_cfg':<28}"
    )
    print(head)
    for r in result["rows"]:
        best = r.get("best_config")
        cfg = (
            ""
            if best is None
            else (
                f"{best['block_v']}x{best['block_m']}x{best['block_k']} w{best['num_warps']}"
                f" s{best['num_stages']} {'fp8' if best['act_fp8'] else 'w8a16'}"
            )
        )
        print(
            f"{r['hidden']:>5} {r['vocab']:>7} {r['m']:>5} {fmt(r.get('bf16_ms'))} "
            f"{fmt(r.get('bf16_argmax_ms'))} {fmt(r.get('scaled_mm_ms'))} {fmt(r.get('fp8_ms'))} "
            f"{fmt(r.get('fused_argmax_ms'))} {fmt(r.get('fused_speedup'), 5, 2)} "
            f"{fmt(r.get('fused_bw_frac'), 5, 2)} {fmt(r.get('fused_argmax_eager_ms'))} "
            f"{fmt(r.get('markov_bf16_argmax_ms'))} {fmt(r.get('markov_fused_ms'))} "
            f"{fmt(r.get('argmax_agreement'), 6, 3)} {fmt(r.get('best_fused_argmax_ms'))} {cfg}"
        )
        if r["errors"]:
            print(f"      errors: {r['errors']}")
    print("\ntargets (graph-replay medians):")
    for name, t in result["targets"].items():
        if isinstance(t, dict):
            values = " ".join(f"{b['m']}:{fmt(b['value'], 1, 2).strip()}" for b in t["by_row"])
            print(f"  {'PASS' if t['pass'] else 'FAIL'}  {name} >= {t['min']}   {values}")
    print(f"  all primary targets pass: {result['targets']['all_pass']}")


def git_commit() -> str:
    # The GPU machine gets a copy of the tree without .git: the caller names the commit.
    if os.environ.get("DSPARK_COMMIT"):
        return os.environ["DSPARK_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write(result: dict, path: Path, started: float) -> None:
    result["targets"] = check_targets(result["rows"])
    result["elapsed_s"] = time.time() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def measure_shape(result: dict, hidden: int, vocab: int, row_counts, args, progress) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(hidden)
    weight = (torch.randn(vocab, hidden, device=DEVICE, generator=g) * 0.02).bfloat16()
    head = Fp8RowwiseWeight.from_weight(weight)
    w2 = (torch.randn(vocab, MARKOV_RANK, device=DEVICE, generator=g) * 0.02).bfloat16()
    w2_fp8 = Fp8RowwiseWeight.from_weight(w2)
    for m in row_counts:
        progress.set_postfix_str(f"{hidden}x{vocab} m={m}")
        point = Point(hidden, vocab, m)
        arms = Arms(weight, head, w2, w2_fp8, m)
        time_arms(point, arms, markov=not args.quick)
        if not args.no_sweep:
            sweep_configs(point, arms)
        derive(point.row, arms, result["copy_bandwidth_gbs"])
        result["rows"].append(point.row)
        write(result, args.out, result["started"])  # a later failure or timeout keeps this
        progress.update()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/fp8_head.json")
    parser.add_argument("--quick", action="store_true", help="one shape, rows 1/64/1792, no Markov")
    parser.add_argument("--no-sweep", action="store_true", help="time only the default configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes, row_counts = (QUICK_SHAPES, QUICK_ROWS) if args.quick else (SHAPES, ROWS)
    major, minor = torch.cuda.get_device_capability()
    result = {
        "command": " ".join(["python", *sys.argv]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "started": time.time(),
        "device": f"{torch.cuda.get_device_name()} (sm_{major}{minor})",
        "capability": [major, minor],
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "timing": "median over 15 CUDA-graph replays of back-to-back calls; *_eager_ms: do_bench",
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
        "rows": [],
        "errors": [],
    }
    progress = tqdm(total=len(shapes) * len(row_counts), desc="fp8 head", file=sys.stderr)
    for hidden, vocab in shapes:
        try:
            measure_shape(result, hidden, vocab, row_counts, args, progress)
        except Exception as error:  # e.g. out of memory at one shape: keep the others
            result["errors"].append(f"{hidden}x{vocab}: {type(error).__name__}: {error}"[:500])
            traceback.print_exc(file=sys.stderr)
        torch.cuda.empty_cache()
    progress.close()
    write(result, args.out, result["started"])
    print_table(result)
    print(f"\nwrote {args.out} in {result['elapsed_s']:.0f} s")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
