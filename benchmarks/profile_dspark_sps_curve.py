"""Profile the target's steps per second against tokens per step (the SPS curve).

    python benchmarks/profile_dspark_sps_curve.py --shape qwen3-8b --out curve.json
    python benchmarks/profile_dspark_sps_curve.py --target /path/to/model --out curve.json

Starts vLLM on the target (dummy weights unless --real-weights), then, inside the
worker, times a decode step for every captured FULL decode CUDA graph (T tokens, one
per request: the shapes vLLM runs in decode), and for a few larger decode steps, which
run without a graph, with the plugin's profiler,
:func:`vllm_dspark.capacity.sps_profile.time_target_steps` (the one ``dspark_sps_curve``
``auto`` runs at start-up): host input preparation, graph replay and the LM head over
the T tokens, median of --rounds groups of --repeats steps. The curve is written as
{"curve": [[T, steps_per_second], ...], ...}, which `dspark_sps_curve` accepts as a
path, and plotted to a PNG beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from shapes import SHAPES, shape_root, write_shape


def time_steps(worker, warmup: int, repeats: int, rounds: int) -> list:
    """Runs inside the vLLM worker."""
    from vllm_dspark.capacity.sps_profile import time_target_steps

    return time_target_steps(worker.model_runner, warmup, repeats, rounds)


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
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="steps per timed group")
    parser.add_argument("--rounds", type=int, default=5, help="timed groups (median)")
    parser.add_argument("--out", type=Path, required=True, help="curve JSON (PNG beside it)")
    args = parser.parse_args()

    # The timing function travels to the worker by value (cloudpickle).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from tqdm import tqdm
    from vllm import LLM

    from vllm_dspark.capacity.sps_profile import curve_from_times

    target = args.target or write_shape(args.shape, shape_root("sps-curve") / args.shape)["target"]
    llm = LLM(
        model=target,
        load_format="auto" if args.real_weights else "dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        # One decode token per request: T requests give a step of T tokens.
        max_num_seqs=args.max_tokens,
        compilation_config={"max_cudagraph_capture_size": args.max_tokens},
        gpu_memory_utilization=0.85,
        seed=0,
    )
    with tqdm(total=1, desc="timing decode steps") as bar:
        per_rank = llm.collective_rpc(time_steps, args=(args.warmup, args.repeats, args.rounds))
        bar.update()
    # Tensor parallel: a step takes as long as its slowest rank.
    rows = [max(points, key=lambda p: p[1]) for points in zip(*per_rank, strict=True)]
    curve = curve_from_times(rows)

    import torch

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "model": args.target or f"{args.shape} shape, dummy weights",
        "repeats": args.repeats,
        "rounds": args.rounds,
        "median_ms": {str(tokens): round(ms, 4) for tokens, ms in rows},
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
