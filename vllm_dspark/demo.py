"""`vllm-dspark demo`: the embedded model pair through vLLM, without and with DSpark.

Runs held-out prompts greedily through vLLM twice (no speculation, then DSpark with k
drafts), and reports tokens per second, the ratio, mean acceptance length, per-position
acceptance, whether the greedy outputs are identical, and how well the drafter's
confidence head predicted acceptance (``dspark_confidence_metrics``, which measures
and changes nothing that is verified).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

from vllm_dspark.metrics import SpecDecodeCounts, confidence_calibration

EMBEDDED_PAIR = Path(str(files("vllm_dspark") / "data" / "tiny_pair"))


@dataclass
class ArmResult:
    tok_s: float
    token_ids: list[list[int]]
    spec: SpecDecodeCounts | None
    calibration: dict | None


def load_prompts(pair_dir: Path = EMBEDDED_PAIR, num_prompts: int | None = 200) -> list[list[int]]:
    """Token ids of the pair's first ``num_prompts`` held-out prompts (never seen in
    training; None: all of them)."""
    prompts = json.loads((pair_dir / "heldout_prompts.json").read_text())
    return [prompt["prompt_token_ids"] for prompt in prompts[:num_prompts]]


def run_arm(pair_dir: Path, prompts, max_tokens: int, k: int | None, dtype: str) -> ArmResult:
    from vllm import LLM, SamplingParams

    speculative = None
    if k is not None:
        speculative = {
            "method": "dspark",
            "model": str(pair_dir / "draft"),
            "num_speculative_tokens": k,
            "dspark_confidence_metrics": True,
        }
        # Reading the calibration counts calls into the worker (see metrics.py).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = LLM(
        model=str(pair_dir / "target"),
        # The prompts are token ids and the outputs are compared as ids.
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=2048,
        max_num_seqs=256,
        # The pair is tiny: 10% of the GPU holds far more KV cache than 200 prompts need.
        gpu_memory_utilization=0.1,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(batch[:8], params, use_tqdm=False)  # warm-up
    before = SpecDecodeCounts.from_metrics(llm.get_metrics())
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    spec = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before if k else None
    calibration = confidence_calibration(llm) if k else None
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    tokens = sum(map(len, token_ids))
    # The engine runs in its own process; touching CUDA here would break the next fork.
    del llm
    gc.collect()
    return ArmResult(tokens / seconds, token_ids, spec, calibration)


def plot_acceptance(per_position: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    positions = range(1, len(per_position) + 1)
    ax.bar(positions, per_position, color="#3b75af")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted share of drafts")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(
    pair_dir: Path = EMBEDDED_PAIR,
    num_prompts: int = 200,
    max_tokens: int = 128,
    k: int = 7,
    dtype: str = "bfloat16",
    plot: str | None = None,
    json_out: str | None = None,
) -> int:
    from vllm.platforms import current_platform

    # vLLM's platform check reads NVML and leaves CUDA uninitialised for the engines.
    if not current_platform.is_cuda():
        print("vllm-dspark demo needs a CUDA GPU, and this machine has none.")
        return 1
    prompts = load_prompts(pair_dir, num_prompts)
    baseline = run_arm(pair_dir, prompts, max_tokens, None, dtype)
    dspark = run_arm(pair_dir, prompts, max_tokens, k, dtype)
    spec = dspark.spec
    identical = baseline.token_ids == dspark.token_ids
    same = sum(a == b for a, b in zip(baseline.token_ids, dspark.token_ids, strict=True))
    print(f"{len(prompts)} held-out prompts, {max_tokens} tokens each, greedy, {dtype}")
    print(f"{'arm':<22}{'tok/s':>10}")
    print(f"{'no speculation':<22}{baseline.tok_s:>10.1f}")
    print(f"{f'DSpark k={k}':<22}{dspark.tok_s:>10.1f}")
    print(f"speed-up {dspark.tok_s / baseline.tok_s:.2f}x")
    print(f"mean acceptance length {spec.acceptance_length:.2f}")
    print("per-position acceptance " + " ".join(f"{a:.2f}" for a in spec.per_position_acceptance))
    print(f"greedy outputs identical: {identical} ({same}/{len(prompts)} prompts)")
    prefix = dspark.calibration["prefix"]
    print("confidence AUROC per position " + " ".join(f"{a:.3f}" for a in prefix["auroc"]))
    print("confidence ECE per position   " + " ".join(f"{e:.3f}" for e in prefix["ece"]))
    if plot:
        title = f"DSpark k={k}, embedded pair: acceptance length {spec.acceptance_length:.2f}"
        plot_acceptance(spec.per_position_acceptance, plot, title)
    if json_out:
        from vllm.platforms import current_platform

        record = {
            "command": " ".join(["vllm-dspark", *sys.argv[1:]]),
            # A copy of the tree without .git (the GPU machine): the caller names the commit.
            "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": current_platform.get_device_name(0),
            "num_prompts": len(prompts),
            "max_tokens": max_tokens,
            "k": k,
            "dtype": dtype,
            "tok_s_nospec": baseline.tok_s,
            "tok_s_dspark": dspark.tok_s,
            "speedup": dspark.tok_s / baseline.tok_s,
            "acceptance_length": spec.acceptance_length,
            "per_position_acceptance": spec.per_position_acceptance,
            "spec_decode_counts": asdict(spec),
            "greedy_identical": identical,
            "greedy_identical_prompts": same,
            "confidence_auroc": prefix["auroc"],
            "confidence_ece": prefix["ece"],
            "confidence_calibration": dspark.calibration,
        }
        Path(json_out).write_text(json.dumps(record, indent=2))
    return 0
