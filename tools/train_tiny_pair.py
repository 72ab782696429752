#!/usr/bin/env python3
"""Train, calibrate, evaluate and export the tiny target / DSpark-drafter pair.

    python tools/train_tiny_pair.py --work-dir /tmp/tiny_work --pack $OUT   # GPU, ~9 min
    python tools/train_tiny_pair.py --smoke --work-dir /tmp/tiny_smoke --export-dir /tmp/x
    python tools/train_tiny_pair.py --work-dir /tmp/w --from-export vllm_dspark/data/tiny_pair \
        --export-dir /tmp/recalibrated     # GPU, ~1 min: recalibrate the shipped pair

A rerun with the same --work-dir skips finished phases and resumes an interrupted one.
Needs torch, transformers, tokenizers, safetensors, numpy and tqdm; not vLLM, not network.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # lab/, vllm_dspark/


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="phase outputs, checkpoints")
    parser.add_argument(
        "--export-dir",
        type=Path,
        default=REPO / "vllm_dspark" / "data" / "tiny_pair",
        help="where target/, draft/ and the model card go",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU end-to-end check")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 autocast on CUDA, float32 on CPU",
    )
    parser.add_argument("--phases", nargs="+", default=None, help="run only these phases")
    parser.add_argument(
        "--from-export",
        type=Path,
        help="take target and drafter from this exported pair (same interpreter's corpus) "
        "and run only the evaluate and export phases: a recalibration without retraining",
    )
    budgets = parser.add_argument_group("time budgets in seconds (defaults from the preset)")
    budgets.add_argument("--target-budget-s", type=float)
    budgets.add_argument("--data-budget-s", type=float)
    budgets.add_argument("--drafter-budget-s", type=float)
    budgets.add_argument(
        "--deadline-s",
        type=float,
        help="finish within this many seconds: later budgets shrink when earlier phases ran long",
    )
    parser.add_argument(
        "--pack",
        type=Path,
        help="also write the export as two tars (< 16 MB each) into this folder",
    )
    parser.add_argument(
        "--unpack", type=Path, help="only extract tars made by --pack into --export-dir"
    )
    return parser.parse_args()


def with_budgets(config, args):
    replace = dataclasses.replace
    if args.target_budget_s is not None:
        config = replace(
            config, target_train=replace(config.target_train, time_budget_s=args.target_budget_s)
        )
    if args.data_budget_s is not None:
        config = replace(
            config, drafter_data=replace(config.drafter_data, time_budget_s=args.data_budget_s)
        )
    if args.drafter_budget_s is not None:
        config = replace(
            config,
            drafter_train=replace(config.drafter_train, time_budget_s=args.drafter_budget_s),
        )
    return config


def main() -> None:
    args = parse_args()
    from lab.tiny_pair import export, train

    if args.unpack is not None:
        export.unpack_export(args.unpack, args.export_dir)
        print(f"unpacked {args.unpack} into {args.export_dir}")
        return

    import torch

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    runtime = train.Runtime(
        device=device, autocast_dtype=torch.bfloat16 if precision == "bf16" else None
    )
    config = train.smoke_config(args.seed) if args.smoke else train.full_config(args.seed)
    config = with_budgets(config, args)
    phases = tuple(args.phases) if args.phases else train.PHASES
    unknown = set(phases) - set(train.PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {train.PHASES}")

    started = time.monotonic()
    train.log(f"device {device}, precision {precision}, work dir {args.work_dir}")
    pipeline = train.Pipeline(config, args.work_dir, args.export_dir, runtime, args.deadline_s)
    if args.from_export is not None:
        pipeline.run(("corpus",))
        pipeline.seed_from_export(args.from_export)
        phases = ("evaluate", "export")
    pipeline.run(phases)
    if args.pack is not None:
        for path in export.pack_export(args.export_dir, args.pack):
            train.log(f"packed {path} ({path.stat().st_size / 1e6:.2f} MB)")
    train.log(f"all done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
