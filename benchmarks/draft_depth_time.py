"""Draft step time against the drafter's physical depth (``dspark_dynamic_depth``).

    python benchmarks/draft_depth_time.py --concurrency 1,64,256 --out depth_time.json

Starts vLLM on the Qwen3-8B shape (dummy weights) with DSpark k=7 and dynamic depth on
(capacity ``budget`` with calibrated synthetic confidence, which dynamic depth needs),
capturing CUDA graphs of exactly the draft and verify sizes of those concurrencies, so
that every draft step below replays a graph. Inside the worker it replays, for each
concurrency R and each depth d, the captured draft graph of d (the whole draft step:
backbone over R x 7 query tokens, then the LM head, Markov loop and confidence head over
d positions), --warmup times and then --repeats times one by one with CUDA events, and
keeps the median. The graph
replays read whatever the buffers hold: timing only, nothing is sampled from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from offline_sweep import DEFAULT_RATES, conditional_rates
from shapes import shape_root, write_shape

K = 7


def time_depth_graphs(worker, concurrencies: list[int], warmup: int, repeats: int) -> list:
    """Runs inside the vLLM worker: median replay ms of each depth's draft graphs."""
    from vllm_dspark.capacity.sps_profile import time_draft_graphs

    speculator = worker.model_runner.speculator
    rows = []
    for depth, manager in sorted(speculator._depth_graphs.items()):
        timed = dict(time_draft_graphs(speculator, manager, warmup, repeats))
        rows += [
            {"concurrency": r, "depth": depth, "draft_ms": timed.get(r)} for r in concurrencies
        ]
    return rows


def depth_ratios(rows: list[dict]) -> dict[str, float]:
    """Per concurrency: draft time at each depth over draft time at full depth."""
    full = {r["concurrency"]: r["draft_ms"] for r in rows if r["depth"] == K}
    return {
        f"{r['concurrency']}/{r['depth']}": round(r["draft_ms"] / full[r["concurrency"]], 4)
        for r in rows
        if r["draft_ms"] is not None and full.get(r["concurrency"])
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    # The timing function travels to the worker by value (cloudpickle).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    paths = write_shape("qwen3-8b", shape_root("draft-depth-time") / "qwen3-8b")
    rates = [float(r) for r in DEFAULT_RATES.split(",")]
    llm = LLM(
        model=paths["target"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max(concurrencies),
        compilation_config={
            "max_cudagraph_capture_size": K * max(concurrencies) + max(concurrencies)
        },
        gpu_memory_utilization=0.85,
        seed=0,
        speculative_config={
            "method": "dspark",
            "model": paths["draft"],
            "num_speculative_tokens": K,
            "dspark_capacity": "budget",
            "dspark_varlen_verify": True,
            "dspark_dynamic_depth": True,
            "dspark_synthetic_confidence": conditional_rates(rates),
        },
    )
    rows = llm.collective_rpc(time_depth_graphs, args=(concurrencies, args.warmup, args.repeats))[0]

    import torch

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "setup": "Qwen3-8B shape, dummy weights, DSpark draft of 2 layers, k=7, bf16",
        "rows": rows,
        "ratio_to_full_depth": depth_ratios(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(record["ratio_to_full_depth"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
