"""How many engine steps a batch of the embedded pair's requests lasts with greedy DSpark
k=7, on the capacity sweep's own prompts (CPU, float32, PyTorch reference pair).

Greedy verification commits the target's greedy continuation whatever the drafts, so each
request's decode steps follow from its drafts alone (``lab.tiny_pair.evaluate``):
after the prefill step (one token), a step from anchor p accepts the a leading drafts that
match and commits a + 1 tokens. With every request submitted at once, as in
``offline_sweep.py``, a batch lasts as many steps as its slowest request needs; this
counts them, against the 128 - 1 decode steps every request takes without speculation, the
step occupancy (requests still decoding) along the way, and per step the drafts the mean
and the worst still-decoding request expect accepted (the sum of their prefix survivals,
from the checkpoint's confidence head and temperatures): what the draft gate weighs with
``dspark_gate_objective`` ``step`` and ``batch``.

    python benchmarks/batch_steps.py --out benchmarks/results/batch_steps_embedded.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/, vllm_dspark/

from offline_sweep import heldout_stream, sweep_prompts  # noqa: E402

from lab.tiny_pair.evaluate import greedy_walk  # noqa: E402
from vllm_dspark.demo import EMBEDDED_PAIR  # noqa: E402
from vllm_dspark.tiny_pair.drafter import SharedTargetWeights  # noqa: E402
from vllm_dspark.tiny_pair.reference import load_reference_pair  # noqa: E402
from vllm_dspark.tiny_pair.target import generate_continuations, target_features  # noqa: E402


def sweep_batches(concurrency: int, repeats: int, min_requests: int) -> list[list[list[int]]]:
    """The prompts of offline_sweep's timed repeats at ``concurrency`` (waves included)."""
    stream = heldout_stream()
    waves = -(-min_requests // concurrency)
    return [
        [p["prompt_token_ids"] for p in sweep_prompts(concurrency, offset, 128, stream)]
        for offset in (
            concurrency + 7 * (repeat * waves + wave)
            for repeat in range(repeats)
            for wave in range(waves)
        )
    ]


@torch.no_grad()
def decode_steps(target, drafter, temperatures, prompts: list[list[int]], output_len, batch):
    """Per request, per decode step (after prefill) until ``output_len`` tokens: the drafts
    the step's proposal expects accepted, the sum of its calibrated prefix survivals."""
    num_drafts = drafter.config.block_size
    shared = SharedTargetWeights(target.model.embed_tokens.weight, target.lm_head.weight)
    scale = torch.tensor(temperatures or [1.0] * num_drafts)
    prompt_len = len(prompts[0])
    # Anchors prompt_len .. prompt_len + output_len - 2, each judged on K tokens after it.
    anchors = torch.arange(prompt_len, prompt_len + output_len - 1)
    offsets = torch.arange(1, num_drafts + 1)
    requests = []
    for start in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[start : start + batch])
        seqs = generate_continuations(target, chunk, output_len + num_drafts, greedy=True)
        features = target_features(target, seqs, drafter.config.target_layer_ids)
        proposal = drafter.propose(
            features.aux_hidden, anchors.expand(len(seqs), -1), seqs[:, anchors], shared
        )
        matches = (proposal.tokens == seqs[:, anchors[:, None] + offsets]).numpy()
        survival = torch.sigmoid(proposal.confidence_logits.float() / scale).cumprod(dim=-1)
        expected = survival.sum(dim=-1).numpy()  # [b, anchors]
        for row, expected_row in zip(matches, expected, strict=True):
            requests.append([float(expected_row[a]) for a, _ in greedy_walk(row)])
    return requests


def batch_row(concurrency: int, per_batch: list[list[list[float]]], output_len: int) -> dict:
    """``per_batch``: per batch, per request, its steps' expected accepted drafts."""
    steps = [[len(request) for request in requests] for requests in per_batch]
    longest = [max(counts) for counts in steps]
    # Per step of each batch, over the requests still decoding: what the draft gate weighs
    # with gate_objective=step (the mean request) and =batch (the request drafting worst).
    # Over every step, and over the steps with at least half the batch still decoding: the
    # mean request's, the worst request's, and the lowest of the requests' means so far.
    weighed = {"all_steps": ([], [], []), "half_full_steps": ([], [], [])}
    for requests in per_batch:
        so_far = [np.cumsum(r) / np.arange(1, len(r) + 1) for r in requests]
        for step in range(max(len(request) for request in requests)):
            active = [i for i, request in enumerate(requests) if len(request) > step]
            now = [requests[i][step] for i in active]
            phases = ["all_steps"] + (["half_full_steps"] if 2 * len(active) >= concurrency else [])
            for phase in phases:
                weighed[phase][0].append(float(np.mean(now)))
                weighed[phase][1].append(min(now))
                weighed[phase][2].append(float(min(so_far[i][step] for i in active)))
    # Requests still decoding at each step of the median-length batch.
    median_batch = steps[int(np.argsort(longest)[len(longest) // 2])]
    occupancy = [sum(s > step for s in median_batch) for step in range(max(median_batch))]
    total = sum(sum(counts) for counts in steps)
    return {
        "concurrency": concurrency,
        "batches": len(per_batch),
        "decode_steps_nospec": output_len - 1,
        "batch_decode_steps": longest,
        # The slowest request's accepted drafts per step, realised over its life.
        "slowest_request_drafts_per_step": [
            round((output_len - 1) / most - 1, 3) for most in longest
        ],
        "mean_request_decode_steps": [round(float(np.mean(counts)), 2) for counts in steps],
        "proposals_per_batch": [sum(counts) for counts in steps],
        "acceptance_length": round((output_len - 1) * len(per_batch) * concurrency / total, 3),
        # Median over steps of the expected accepted drafts the gate would weigh.
        "expected_drafts_median_step": {
            phase: {
                "mean_request": round(float(np.median(mean)), 3),
                "worst_request": round(float(np.median(worst)), 3),
                "worst_request_mean_so_far": round(float(np.median(worst_so_far)), 3),
            }
            for phase, (mean, worst, worst_so_far) in weighed.items()
        },
        "occupancy_median_batch": occupancy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="sequences per drafter pass")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    target, drafter, temperatures = load_reference_pair(EMBEDDED_PAIR)
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        per_batch = [
            decode_steps(target, drafter, temperatures, prompts, args.output_len, args.batch)
            for prompts in sweep_batches(concurrency, args.repeats, args.min_requests)
        ]
        rows.append(batch_row(concurrency, per_batch, args.output_len))
        print({k: v for k, v in rows[-1].items() if k != "occupancy_median_batch"}, flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python benchmarks/batch_steps.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": "CPU (float32 PyTorch reference pair, no GPU)",
        "setup": "embedded pair, greedy, k=7, every draft verified, offline_sweep's held-out "
        "prompts (128 tokens), 128 output tokens",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
