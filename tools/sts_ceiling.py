"""How low Sequential Temperature Scaling can bring the embedded drafter's ECE, on CPU.

    python tools/sts_ceiling.py --out benchmarks/results/sts_ceiling.json

The online-STS target asks for a per-position ECE of at most 0.03 (prefix survival s_k
against "drafts 1..k all accepted", 15 bins). This measures what any choice of
temperatures can reach on this head, outside vLLM: greedy verify steps of the embedded
pair in PyTorch (held-out prompts, k=7, as ``tools/train_tiny_pair.py`` evaluates),
then per position the ECE at temperature 1 and at the checkpoint's temperatures, the
best in-sample STS fit (a lower bound for every online fit on the same steps), the STS
fit of one half of the prompts scored on the other half (what a fit meets on fresh
traffic), the ECE a perfectly calibrated head would show on as many steps (outcomes drawn
from its own survivals: the noise floor), and the reliability table at the checkpoint's
temperatures. Minutes on CPU. Beside STS, the same sequential in-sample fit with a bias
per position as well (Platt scaling, sigmoid(z_k / T_k + b_k)): whether a calibration
richer than a temperature, still one monotone map per position, could reach the target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/, vllm_dspark/

from lab.tiny_pair.calibration import (  # noqa: E402
    DEFAULT_NUM_BINS,
    calibration_report,
    expected_calibration_error,
    fit_sequential_temperature_scaling,
    survival,
    survival_events,
    temperature_grid,
)
from vllm_dspark.tiny_pair.drafter import sigmoid  # noqa: E402

NOISE_DRAWS = 200
PLATT_BIASES = np.linspace(-2.0, 2.0, 81)


def fit_sequential_platt(logits: np.ndarray, accepted: np.ndarray) -> dict:
    """Per position in order, the (T_k, b_k) of the grids minimising ECE(s_k, survived_k)
    given the earlier positions' fits, s_k the product of sigmoid(z_j / T_j + b_j)."""
    z, events = np.asarray(logits, dtype=np.float64), survival_events(accepted)
    temperatures, biases, eces = [], [], []
    prefix = np.ones(len(z))
    for k in range(z.shape[1]):
        best = (np.inf, 1.0, 0.0)
        for temperature in temperature_grid(61):
            candidates = prefix * sigmoid(z[:, k] / temperature + PLATT_BIASES[:, None])
            errors = [expected_calibration_error(c, events[:, k]) for c in candidates]
            index = int(np.argmin(errors))
            if errors[index] < best[0]:
                best = (errors[index], float(temperature), float(PLATT_BIASES[index]))
        eces.append(best[0])
        temperatures.append(best[1])
        biases.append(best[2])
        prefix = prefix * sigmoid(z[:, k] / best[1] + best[2])
    return {"temperatures": temperatures, "biases": biases, "ece": eces}


def split_by_prompt(prompt_of_step: np.ndarray, seed: int) -> np.ndarray:
    """A mask of the steps whose prompt falls in a random half of the prompts."""
    prompts = np.unique(prompt_of_step)
    half = np.random.default_rng(seed).permutation(prompts)[: len(prompts) // 2]
    return np.isin(prompt_of_step, half)


def noise_floor(predicted: np.ndarray, draws: int, seed: int = 0) -> list[float]:
    """Mean ECE per position of a head whose survivals ``predicted`` [n, K] are exact:
    outcomes drawn from them, nested (surviving k needs surviving k - 1)."""
    rng = np.random.default_rng(seed)
    conditional = predicted / np.concatenate([np.ones((len(predicted), 1)), predicted[:, :-1]], 1)
    totals = np.zeros(predicted.shape[1])
    for _ in range(draws):
        events = np.cumprod(rng.random(predicted.shape) < conditional, axis=1)
        totals += [
            expected_calibration_error(predicted[:, k], events[:, k])
            for k in range(predicted.shape[1])
        ]
    return (totals / draws).tolist()


def reliability(predicted: np.ndarray, observed: np.ndarray) -> list[dict]:
    """Per non-empty bin: mean predicted, observed rate, count."""
    bins = np.clip((predicted * DEFAULT_NUM_BINS).astype(int), 0, DEFAULT_NUM_BINS - 1)
    return [
        {
            "predicted": round(float(predicted[bins == b].mean()), 4),
            "observed": round(float(observed[bins == b].mean()), 4),
            "count": int((bins == b).sum()),
        }
        for b in range(DEFAULT_NUM_BINS)
        if (bins == b).any()
    ]


def study(
    logits: np.ndarray, accepted: np.ndarray, prompt_of_step: np.ndarray, checkpoint_t, splits: int
) -> dict:
    """Every figure of the module docstring, from verify records."""
    fit = fit_sequential_temperature_scaling(logits, accepted)
    held_out = []
    for seed in range(splits):
        half = split_by_prompt(prompt_of_step, seed)
        for fit_on, score_on in ((half, ~half), (~half, half)):
            temperatures = fit_sequential_temperature_scaling(
                logits[fit_on], accepted[fit_on]
            ).temperatures
            scored = calibration_report(logits[score_on], accepted[score_on], temperatures)
            held_out.append(scored["ece_sts"])
    events = survival_events(accepted)
    at_checkpoint = survival(logits, checkpoint_t)
    return {
        "steps": len(logits),
        "ece_temperature_1": fit.ece_before,
        "ece_checkpoint_temperatures": calibration_report(logits, accepted, checkpoint_t)[
            "ece_sts"
        ],
        "sts_in_sample": {"temperatures": fit.temperatures, "ece": fit.ece_after},
        "platt_in_sample": fit_sequential_platt(logits, accepted),
        "sts_fit_on_half_scored_on_other_half": np.mean(held_out, axis=0).tolist(),
        "noise_floor_same_steps": noise_floor(at_checkpoint, NOISE_DRAWS),
        "reliability_checkpoint_temperatures": [
            reliability(at_checkpoint[:, k], events[:, k]) for k in range(logits.shape[1])
        ],
    }


def simulate(num_prompts: int, new_tokens: int, threads: int):
    """(confidence logits [n, K], accepted [n, K], prompt of each step [n], checkpoint
    temperatures) of greedy verify steps over the first ``num_prompts`` held-out prompts."""
    import torch

    from lab.tiny_pair.evaluate import verify_records
    from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts
    from vllm_dspark.tiny_pair.reference import load_reference_pair

    torch.set_num_threads(threads)
    target, drafter, temperatures = load_reference_pair(EMBEDDED_PAIR)
    prompts = np.array(load_prompts(EMBEDDED_PAIR, num_prompts), dtype=np.int64)
    records, prompt_of_step = verify_records(target, drafter, prompts, new_tokens, False)
    return records.confidence_logits, records.accepted, prompt_of_step, temperatures


def cpu_record_header() -> dict:
    """Command, commit, date and device of a CPU result record."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.machine()}), PyTorch, float32",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--splits", type=int, default=4, help="random halvings of the prompts")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logits, accepted, prompt_of_step, checkpoint_t = simulate(
        args.prompts, args.new_tokens, args.threads
    )
    record = {
        **cpu_record_header(),
        "setup": f"embedded pair, k={accepted.shape[1]}, greedy, {args.prompts} held-out prompts, "
        f"{args.new_tokens} new tokens, {DEFAULT_NUM_BINS} bins",
        "checkpoint_temperatures": checkpoint_t,
        **study(logits, accepted, prompt_of_step, checkpoint_t, args.splits),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for key in (
        "ece_temperature_1",
        "ece_checkpoint_temperatures",
        "sts_fit_on_half_scored_on_other_half",
        "noise_floor_same_steps",
    ):
        print(key, [round(v, 4) for v in record[key]])
    for key in ("sts_in_sample", "platt_in_sample"):
        print(key, [round(v, 4) for v in record[key]["ece"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
