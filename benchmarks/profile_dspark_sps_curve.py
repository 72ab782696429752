"""Profile the target's steps per second against tokens per step (the SPS curve).

    python benchmarks/profile_dspark_sps_curve.py --shape qwen3-8b --out curve.json
    python benchmarks/profile_dspark_sps_curve.py --target /path/to/model --out curve.json

Starts vLLM on the target (dummy weights unless --real-weights), then, inside the
worker, replays each captured FULL decode CUDA graph: T tokens per step for every
captured T, one token per request (the shapes vLLM runs in decode), every request
attending a context of --context-len tokens. Each T gets --warmup replays, then
--repeats replays timed one by one with CUDA events; the median is kept. The curve is
written as {"curve": [[T, steps_per_second], ...], ...}, which `dspark_sps_curve`
accepts as a path, and plotted to a PNG beside it.

What it measures is the GPU time of the target forward; the host's per-step work is
not in it (see benchmarks/step_breakdown.py for that split).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from shapes import SHAPES, write_shape


def time_decode_graphs(worker, warmup: int, repeats: int, context_len: int) -> list:
    """Runs inside the vLLM worker: median replay time of each FULL decode graph."""
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    runner = worker.model_runner
    manager = runner.cudagraph_manager
    descs = sorted(
        (d for d in manager.graphs if d.cg_mode == CUDAGraphMode.FULL and d.uniform_token_count),
        key=lambda d: d.num_tokens,
    )
    buffers, tables = runner.input_buffers, runner.block_tables
    # Real-looking decode state: every request reads context_len tokens of KV from
    # blocks of its own (block 0 is left out), and writes nothing (padded slots), so
    # the KV cache stays as it was.
    buffers.seq_lens.fill_(context_len)
    for group, table in enumerate(tables.input_block_tables):
        num_blocks = runner.kv_cache_config.num_blocks * tables.blocks_per_kv_block[group]
        per_req = min(table.shape[1], -(-context_len // tables.kernel_block_sizes[group]))
        ids = torch.arange(table.shape[0] * per_req, device=table.device) % (num_blocks - 1)
        table[:, :per_req] = (ids + 1).view(table.shape[0], per_req).to(table.dtype)
    tables.slot_mappings.fill_(PAD_SLOT_ID)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    results = []
    for desc in descs:
        graph = manager.graphs[desc]
        for _ in range(warmup):
            graph.replay()
        times = []
        for _ in range(repeats):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        results.append((desc.num_tokens, desc.num_reqs, statistics.median(times)))
    return results


def plot(curve: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, sps = zip(*curve, strict=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.plot(tokens, sps, marker=".")
    ax1.set_xlabel("tokens per step T")
    ax1.set_ylabel("target steps per second")
    ax2.plot(tokens, [t * s for t, s in curve], marker=".", color="#c0504d")
    ax2.set_xlabel("tokens per step T")
    ax2.set_ylabel("tokens per second (T x SPS)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="path of the target model folder")
    source.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen3 shape, dummy weights")
    parser.add_argument("--real-weights", action="store_true", help="load --target's weights")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="largest T: the largest captured batch"
    )
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True, help="curve JSON (PNG beside it)")
    args = parser.parse_args()

    # The timing function travels to the worker by value (cloudpickle).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from tqdm import tqdm
    from vllm import LLM

    target = args.target or write_shape(args.shape, Path(tempfile.mkdtemp()))["target"]
    llm = LLM(
        model=target,
        load_format="auto" if args.real_weights else "dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max(2048, 2 * args.context_len),
        # One decode token per request: T requests give a step of T tokens.
        max_num_seqs=args.max_tokens,
        compilation_config={"max_cudagraph_capture_size": args.max_tokens},
        gpu_memory_utilization=0.85,
        seed=0,
    )
    with tqdm(total=1, desc="replaying decode graphs") as bar:
        per_rank = llm.collective_rpc(
            time_decode_graphs, args=(args.warmup, args.repeats, args.context_len)
        )
        bar.update()
    # Tensor parallel: a step takes as long as its slowest rank.
    rows = [max(points, key=lambda p: p[2]) for points in zip(*per_rank, strict=True)]
    curve = [[tokens, round(1000.0 / ms, 2)] for tokens, _, ms in rows]

    import torch

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "model": args.target or f"{args.shape} shape, dummy weights",
        "context_len": args.context_len,
        "repeats": args.repeats,
        "median_ms": {str(tokens): round(ms, 4) for tokens, _, ms in rows},
        "curve": curve,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    plot(curve, args.out.with_suffix(".png"), f"{record['model']} on {record['device']}")
    for tokens, sps in curve:
        print(f"T={tokens:5d}  {sps:9.1f} steps/s  {tokens * sps:10.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
