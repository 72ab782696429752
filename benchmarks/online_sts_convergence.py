"""Online Sequential Temperature Scaling from temperature 1, on the embedded pair.

    python benchmarks/online_sts_convergence.py --out online_sts.json

One engine: DSpark k=7 with every draft verified (``budget`` 1.0, so calibration sees
every position uncensored), the confidence head started at temperature 1
(``dspark_confidence_temperature``), ``dspark_online_sts`` and the calibration metrics
on. It serves chunks of prompts (variants of held-out prompts 200-255, cut at varying
lengths) at --concurrency until online STS has observed --steps steps, recording after
each chunk the steps so far, the temperatures and the per-position ECE of that chunk's
verifications (survival, 15 bins); then, refits stopped so that the temperatures are the
ones reached within --steps steps, it serves the 200 held-out prompts of the demo as the
evaluation window. A second engine without speculation serves the same 200 prompts:
greedy outputs must be identical; a prompt whose output differs is served again alone by
that engine, which tells whether stock vLLM's own output for it depends on the batch.
Both engines in --dtype (float32 by default, so that bf16 ties do not blur the
comparison).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
from pathlib import Path

K = 7


def _reset_calibration(worker) -> None:
    from vllm_dspark.capacity.calibration_stats import CalibrationStats

    speculator = worker.model_runner.speculator
    speculator.calibration = CalibrationStats(speculator.num_speculative_steps, speculator.device)


def _sts_state(worker) -> dict:
    speculator = worker.model_runner.speculator
    sts = speculator.online_sts
    return {
        "steps": sts.steps,
        "refits": sts.refits,
        "last_refit_step": sts.fitted_at_step,  # the temperatures in use were fitted here
        "temperatures": [round(t, 4) for t in speculator.temperatures.tolist()],
    }


def _stop_refitting(worker) -> None:
    """Keep the temperatures online STS has reached: no refit during the evaluation."""
    worker.model_runner.speculator.online_sts.refit_every = sys.maxsize


def warm_prompts(prompts: list[list[int]], count: int, seed: int) -> list[list[int]]:
    """``count`` variants of ``prompts``, each cut to a random length of at least 16."""
    rng = random.Random(seed)
    return [prompt[: rng.randint(16, len(prompt))] for prompt in rng.choices(prompts, k=count)]


def serve(llm, prompts, max_tokens: int, logprobs: bool = False):
    """Greedy token ids per prompt; with ``logprobs``, (ids, each position's top two)."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2 if logprobs else None
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids = [list(out.outputs[0].token_ids) for out in outputs]
    if not logprobs:
        return ids
    return ids, [out.outputs[0].logprobs for out in outputs]


def divergences(online, reference, reference_logprobs) -> list[dict]:
    """Each prompt whose output differs: where, and how near a tie the greedy choice was
    there without speculation (the top two log-probabilities' gap)."""
    found = []
    for prompt, (a, b) in enumerate(zip(online, reference, strict=True)):
        if a == b:
            continue
        position = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        ranked = sorted(lp.logprob for lp in reference_logprobs[prompt][position].values())
        gap = ranked[-1] - ranked[-2]
        found.append({"prompt": prompt, "position": position, "top_two_gap": round(gap, 7)})
    return found


def make_llm(pair: Path, speculative: dict | None, args):
    from vllm import LLM

    return LLM(
        model=str(pair / "target"),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        seed=0,
        max_model_len=2048,
        max_num_seqs=args.concurrency,
        # A fixed cache skips vLLM's memory profiling, which an engine starting beside it
        # on the same GPU would disturb (tools/device/queue.sh runs stages side by side).
        kv_cache_memory_bytes=2 << 30,
        # Chunks reuse prompts; the drafter's context must come from the target each time.
        enable_prefix_caching=False,
        disable_log_stats=False,
        speculative_config=speculative,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=64, help="prompts per warm chunk")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts
    from vllm_dspark.metrics import confidence_calibration

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # calls into the worker
    held_out = load_prompts(EMBEDDED_PAIR, 256)
    evaluation, pool = held_out[:200], held_out[200:]
    llm = make_llm(
        EMBEDDED_PAIR,
        {
            "method": "dspark",
            "model": str(EMBEDDED_PAIR / "draft"),
            "num_speculative_tokens": K,
            "dspark_capacity": "budget",
            "dspark_budget_frac": 1.0,
            "dspark_varlen_verify": True,
            "dspark_confidence_temperature": [1.0] * K,
            "dspark_online_sts": True,
            "dspark_confidence_metrics": True,
        },
        args,
    )
    chunks = []
    while True:
        state = llm.collective_rpc(_sts_state)[0]
        if state["steps"] >= args.steps:
            break
        llm.collective_rpc(_reset_calibration)
        serve(llm, warm_prompts(pool, args.chunk, seed=len(chunks)), args.max_tokens)
        ece = confidence_calibration(llm)["prefix"]["ece"]
        chunks.append({**llm.collective_rpc(_sts_state)[0], "chunk_ece": ece})
        print(json.dumps(chunks[-1]), flush=True)
    llm.collective_rpc(_reset_calibration)
    llm.collective_rpc(_stop_refitting)
    online = serve(llm, evaluation, args.max_tokens)
    calibration = confidence_calibration(llm)
    final = llm.collective_rpc(_sts_state)[0]
    del llm
    gc.collect()
    reference_llm = make_llm(EMBEDDED_PAIR, None, args)
    reference, reference_logprobs = serve(reference_llm, evaluation, args.max_tokens, logprobs=True)
    found = divergences(online, reference, reference_logprobs)
    for divergence in found:
        # Without speculation too, served alone instead of among the batch: whether stock
        # vLLM's own output for this prompt depends on the batch it runs in.
        alone = serve(reference_llm, [evaluation[divergence["prompt"]]], args.max_tokens)[0]
        divergence["reference_alone_equals_batched"] = alone == reference[divergence["prompt"]]
        divergence["speculative_equals_reference_alone"] = alone == online[divergence["prompt"]]

    import torch

    identical = sum(a == b for a, b in zip(online, reference, strict=True))
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "setup": f"embedded pair, k={K}, {args.dtype}, concurrency {args.concurrency}, "
        "budget 1.0, temperatures started at 1",
        "warm_chunks": chunks,
        "evaluation": {
            "steps_before": state["steps"],
            # The temperatures evaluated (kept, no refit during the evaluation) were fitted
            # at this step.
            "last_refit_step": state["last_refit_step"],
            "steps_after": final["steps"],
            "temperatures": final["temperatures"],
            "ece": calibration["prefix"]["ece"],
            # What an exactly calibrated head would show on these trials (see
            # vllm_dspark.capacity.calibration_stats): read the ECE against it.
            "ece_noise_floor": calibration["prefix"]["ece_noise_floor"],
            # Fully verified rows: ~200 x 127 / acceptance length, plus the step or two per
            # request that async scheduling runs past its stop (vLLM's spec-decode counters
            # skip those, vllm/v1/core/sched/scheduler.py update_from_output; the GPU
            # verified them, so they count here).
            "trials": calibration["prefix"]["trials"],
            "auroc": calibration["prefix"]["auroc"],
            "conditional_ece": calibration["conditional"]["ece"],
            "max_ece": max(calibration["prefix"]["ece"]),
        },
        "greedy_identical_prompts": identical,
        "greedy_identical": identical == len(evaluation),
        "divergences": found,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record["evaluation"]), f"identical {identical}/{len(evaluation)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
