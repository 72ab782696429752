"""Online STS on the embedded pair, replayed on CPU as the GPU run feeds it.

    python tools/online_sts_replay.py --out benchmarks/results/online_sts_replay.json

What ``benchmarks/online_sts_convergence.py`` (the ``sts`` GPU stage) measures, predicted
in PyTorch (float32, greedy, k = 7, outside vLLM): the warm-up traffic is the same, chunks
of --chunk variants of the shipped prompts 200-255 cut at random lengths (its own
``warm_prompts``, seeded per chunk); every draft verified; ``OnlineSTS`` from temperature
1 takes --concurrency verify rows per step for --steps steps; then the ECE of the
survival (15 bins) at its temperatures on the shipped prompts 0-199. Rows enter in a
shuffled order, one per --orders seed (the engine interleaves its requests' steps; the
spread over orders is what that order is worth). The ECE at temperature 1 is given beside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lab/, vllm_dspark/
sys.path.insert(0, str(ROOT / "benchmarks"))  # online_sts_convergence
sys.path.insert(0, str(ROOT / "tools"))  # refit_confidence_head, sts_ceiling

from online_sts_convergence import warm_prompts  # noqa: E402
from refit_confidence_head import online_sts  # noqa: E402
from sts_ceiling import cpu_record_header  # noqa: E402

from lab.tiny_pair.calibration import calibration_report  # noqa: E402
from lab.tiny_pair.evaluate import verify_records  # noqa: E402
from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts  # noqa: E402
from vllm_dspark.tiny_pair.reference import load_reference_pair  # noqa: E402

EVALUATED = 200  # the shipped prompts the GPU run evaluates on; the rest warm it up


def records_of(target, drafter, prompts: list[list[int]], new_tokens: int):
    """(confidence logits, accepted) of every verify step of ``prompts``, which may differ
    in length (verified in groups of one length)."""
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(prompt)
    logits, accepted = [], []
    for group in by_length.values():
        records, _ = verify_records(
            target, drafter, np.array(group, dtype=np.int64), new_tokens, keep_inputs=False
        )
        logits.append(records.confidence_logits)
        accepted.append(records.accepted)
    return np.concatenate(logits), np.concatenate(accepted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20, help="warm-up chunks")
    parser.add_argument("--chunk", type=int, default=64, help="prompts per warm-up chunk")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16, help="verify rows per step")
    parser.add_argument("--orders", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, drafter, _ = load_reference_pair(EMBEDDED_PAIR)
    shipped = [list(prompt) for prompt in load_prompts(EMBEDDED_PAIR, 256)]
    evaluated = records_of(target, drafter, shipped[:EVALUATED], args.new_tokens)
    pool = shipped[EVALUATED:]
    warm = [p for chunk in range(args.chunks) for p in warm_prompts(pool, args.chunk, chunk)]
    warm_logits, warm_accepted = records_of(target, drafter, warm, args.new_tokens)

    def ece(temperatures: list[float]) -> list[float]:
        return calibration_report(*evaluated, temperatures)["ece_sts"]

    orders = []
    for seed in range(args.orders):
        temperatures, refits = online_sts(
            warm_logits, warm_accepted, args.steps, args.concurrency, seed
        )
        errors = ece(temperatures)
        orders.append({"seed": seed, "temperatures": temperatures, "refits": refits, "ece": errors})
        print(f"order {seed}: ECE {[round(e, 3) for e in errors]}", flush=True)
    worst = [max(order["ece"]) for order in orders]
    record = {
        **cpu_record_header(),
        "setup": (
            f"embedded pair, k={drafter.config.block_size}, greedy, {args.new_tokens} new "
            f"tokens; warm-up: {args.chunks} x {args.chunk} cut variants of shipped prompts "
            f"200-255 ({len(warm_logits)} verify steps), {args.steps} steps x "
            f"{args.concurrency} rows; evaluated on shipped prompts 0-199 "
            f"({len(evaluated[0])} verify steps), survival ECE, 15 bins"
        ),
        "ece_temperature_1": ece([1.0] * warm_logits.shape[1]),
        "orders": orders,
        "worst_position_ece_per_order": worst,
        "worst_position_ece_max": max(worst),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("worst position per order:", [round(w, 3) for w in worst])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
