"""Refit the embedded pair's confidence head on CPU, one row per draft position.

    python tools/refit_confidence_head.py --out benchmarks/results/confidence_head_refit.json \
        [--write-pair]

With one row shared by every position over ``[h ; markov ; l]`` (l: the draft's top-1
log-probability), no choice of STS temperatures brings the pair's survival ECE at
position 2 under 0.042 (``sts_ceiling.json``). This refits the head as
``lab.tiny_pair.evaluate.refit_position_heads`` does at the end of training, one row per
position over ``[h ; markov ; l ; log(1 - e^l)]``, and measures both heads on the same
steps. Everything in PyTorch, float32, greedy, k = 7, outside vLLM:

1. the held-out files of this interpreter (training's split rule, a path hash), split in
   two halves by file: --calibration-prompts 64-token windows of one half fit the head and
   its STS temperatures; --warm-prompts windows of the other half feed online STS;
2. on the 256 shipped held-out prompts (the ones the demo and the GPU online-STS run
   serve), per head: AUROC and ECE of the prefix survival at temperature 1, at the STS
   temperatures fitted on the calibration windows, the in-sample STS ceiling and the noise
   floor (``sts_ceiling.study``);
3. online STS as the plugin runs it (``OnlineSTS``, from temperature 1, every draft
   verified): the warm windows' steps in a fixed shuffled order, --concurrency rows per
   step, for --steps steps; then the ECE of its temperatures on the shipped prompts 0-199.

``--write-pair`` rewrites the pair's ``draft/`` files: the confidence tensors, the config
keys and ``dspark_calibration.json`` (the other tensors are written back unchanged).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/, vllm_dspark/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sts_ceiling

from sts_ceiling import cpu_record_header, study  # noqa: E402

from lab.tiny_pair import corpus, export  # noqa: E402
from lab.tiny_pair.calibration import (  # noqa: E402
    calibration_report,
    fit_sequential_temperature_scaling,
)
from lab.tiny_pair.evaluate import (  # noqa: E402
    head_logits,
    refit_position_heads,
    sample_prompts,
    verify_records,
    with_position_heads,
)
from vllm_dspark.capacity.online_sts import OnlineSTS  # noqa: E402
from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts  # noqa: E402
from vllm_dspark.tiny_pair.drafter import DSparkDrafter  # noqa: E402
from vllm_dspark.tiny_pair.load import CONFIDENCE_PREFIX  # noqa: E402
from vllm_dspark.tiny_pair.reference import load_reference_pair  # noqa: E402

PROMPT_LEN = 64
HELDOUT_BYTES = 64 * 1024 * 1024  # every held-out file of a stdlib + site-packages


@functools.cache
def heldout_tokens(half: int) -> np.ndarray:
    """The held-out files of one half (0 or 1, every other file), tokenised end to end."""
    tokenizer = Tokenizer.from_file(str(EMBEDDED_PAIR / "target" / "tokenizer.json"))
    _, texts = corpus.read_split_texts(corpus.list_source_files(), 0, HELDOUT_BYTES)
    return corpus.tokenize_documents(tokenizer, texts[half::2]).astype(np.int64)


def heldout_windows(count: int, half: int, seed: int, exclude: set) -> np.ndarray:
    """``count`` 64-token windows of one half of the held-out files, none in ``exclude``."""
    tokens = heldout_tokens(half)
    windows = sample_prompts(tokens, 2 * count, PROMPT_LEN, np.random.default_rng(seed))
    kept = [w for w in windows if tuple(w.tolist()) not in exclude]
    return np.stack(kept[:count])


def online_sts(logits: np.ndarray, accepted: np.ndarray, steps: int, rows: int, seed: int):
    """Temperatures OnlineSTS reaches from 1 after ``steps`` steps of ``rows`` verify rows."""
    order = np.random.default_rng(seed).permutation(len(logits))
    assert steps * rows <= len(order), f"{len(order)} warm rows, {steps} x {rows} needed"
    num_drafts = logits.shape[1]
    temperatures = torch.ones(num_drafts, dtype=torch.float64)
    sts = OnlineSTS(temperatures.clone())
    accepted_count = torch.as_tensor(np.cumprod(accepted, axis=1).sum(axis=1))
    verified = torch.full((rows,), num_drafts)
    for step in range(steps):
        chunk = torch.as_tensor(order[step * rows : (step + 1) * rows])
        sts.observe(torch.as_tensor(logits)[chunk], verified, accepted_count[chunk], temperatures)
        sts.maybe_refit(temperatures)
    return temperatures.tolist(), sts.refits


def head_study(name, logits, records, prompt_of_step, calibration_t, online_t, online_rows):
    report = study(logits, records.accepted, prompt_of_step, calibration_t, splits=4)
    online = prompt_of_step < online_rows  # the shipped prompts 0-199
    return {
        "head": name,
        "auroc": calibration_report(logits, records.accepted, None)["auroc"],
        "sts_temperatures_from_calibration_windows": calibration_t,
        "ece_at_those_temperatures": report["ece_checkpoint_temperatures"],
        "online_sts_temperatures": online_t,
        "ece_online_sts_prompts_0_199": calibration_report(
            logits[online], records.accepted[online], online_t
        )["ece_sts"],
        **{k: v for k, v in report.items() if k != "ece_checkpoint_temperatures"},
    }


def write_pair(drafter: DSparkDrafter, head: dict, calibration: dict) -> None:
    """The pair's draft/ files with the refitted head (other tensors unchanged)."""
    draft_dir = EMBEDDED_PAIR / "draft"
    raw = json.loads((draft_dir / "config.json").read_text())
    special_ids = {
        corpus.EOS_TOKEN: raw["eos_token_id"],
        corpus.PAD_TOKEN: raw["pad_token_id"],
        corpus.MASK_TOKEN: raw["dflash_config"]["mask_token_id"],
    }
    refitted = DSparkDrafter(with_position_heads(drafter.config))
    state = drafter.state_dict()
    state.update({f"{CONFIDENCE_PREFIX}{k}": v for k, v in head.items()})
    refitted.load_state_dict(state)
    export.export_draft(refitted, special_ids, calibration, draft_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration-prompts", type=int, default=2048)
    parser.add_argument("--warm-prompts", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000, help="online STS steps")
    parser.add_argument("--concurrency", type=int, default=16, help="verify rows per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-pair", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, drafter, checkpoint_t = load_reference_pair(EMBEDDED_PAIR)
    weights = (EMBEDDED_PAIR / "draft" / "model.safetensors").read_bytes()
    shipped = np.array(load_prompts(EMBEDDED_PAIR, None), dtype=np.int64)
    exclude = {tuple(p.tolist()) for p in shipped}
    hidden_and_rank = drafter.config.hidden_size + drafter.config.markov_rank
    sets = {
        "calibration": heldout_windows(args.calibration_prompts, 0, 0, exclude),
        "warm": heldout_windows(args.warm_prompts, 1, 1, exclude),
        "shipped": shipped,
    }
    records, prompt_of_step = {}, {}
    for name, prompts in sets.items():
        records[name], prompt_of_step[name] = verify_records(
            target, drafter, prompts, args.new_tokens, keep_inputs=True
        )

    head = refit_position_heads(records["calibration"], hidden_and_rank)
    heads = {"shipped": {}, "refitted": {}}
    for name, split in records.items():
        heads["shipped"][name] = split.confidence_logits
        heads["refitted"][name] = head_logits(split, head, hidden_and_rank)
    calibration_accepted = records["calibration"].accepted
    fits = {
        name: fit_sequential_temperature_scaling(logits["calibration"], calibration_accepted)
        for name, logits in heads.items()
    }
    results = []
    for name, logits in heads.items():
        online_t, refits = online_sts(
            logits["warm"], records["warm"].accepted, args.steps, args.concurrency, seed=0
        )
        results.append(
            head_study(
                name,
                logits["shipped"],
                records["shipped"],
                prompt_of_step["shipped"],
                fits[name].temperatures,
                online_t,
                online_rows=200,
            )
            | {"online_sts_refits": refits}
        )

    record = {
        **cpu_record_header(),
        "setup": (
            f"embedded pair, k={drafter.config.block_size}, greedy, {args.new_tokens} new tokens, "
            f"15 bins; windows of the held-out files of Python {platform.python_version()}'s "
            f"stdlib and site-packages; calibration: {args.calibration_prompts} windows "
            f"({records['calibration'].num_steps} verify steps); online STS: {args.steps} steps "
            f"x {args.concurrency} rows of {args.warm_prompts} other windows "
            f"({records['warm'].num_steps} verify steps); evaluated on the 256 shipped "
            f"prompts ({records['shipped'].num_steps} verify steps)"
        ),
        # Which head "shipped" is: the pair's draft weights when the run started.
        "draft_weights_sha256_at_start": hashlib.sha256(weights).hexdigest(),
        "checkpoint_temperatures_before": checkpoint_t,
        "heads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for result in results:
        print(result["head"])
        for key in (
            "auroc",
            "ece_temperature_1",
            "ece_at_those_temperatures",
            "sts_in_sample",
            "ece_online_sts_prompts_0_199",
            "noise_floor_same_steps",
        ):
            values = result[key]["ece"] if key == "sts_in_sample" else result[key]
            print(f"  {key:32s}", [round(v, 3) for v in values])
    if args.write_pair:
        refit = fits["refitted"]
        write_pair(
            drafter,
            head,
            {
                "method": "sts",
                "temperatures": refit.temperatures,
                "applies_to": "confidence logit z_k; c_k = sigmoid(z_k / T_k), k = 1..K",
                "num_bins": 15,
                "fitted_on": f"{records['calibration'].num_steps} verify steps, "
                f"{args.calibration_prompts} held-out windows, greedy, float32 (CPU)",
                "ece_before": refit.ece_before,
                "ece_after_on_fit_split": refit.ece_after,
                "confidence_head_refitted": True,
                "refitted_by": "tools/refit_confidence_head.py",
            },
        )
        print(f"wrote {EMBEDDED_PAIR / 'draft'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
