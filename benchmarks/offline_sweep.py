"""Offline throughput of several arms at several concurrencies, one engine per arm.

    python benchmarks/offline_sweep.py --pair qwen3-8b --arms nospec,dspark,dspark-fp8 \
        --concurrency 1,16 --out benchmarks/results/fp8_e2e.json

Each arm runs in a fresh process (`LLM()`, greedy, EOS ignored). For each concurrency
c it submits c prompts of --prompt-len tokens at once, --output-len tokens each, after
a warm-up, and reports output tokens per second and the spec-decode counters of the
run. ``--pair qwen3-8b`` uses dummy weights with synthetic acceptance derived from
``--rates`` (per-position unconditional acceptance): ``--acceptance rates`` is vLLM's own
(one fixed rate per position), ``--acceptance confidence`` draws per-draft confidences
around the same conditional rates and accepts each draft with its confidence
(``dspark_synthetic_confidence``: what capacity control needs; DFlash arms, which have no
confidence head, keep vLLM's rates). ``--pair embedded`` uses the trained pair with real
verification (DSpark arms only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from shapes import SHAPES, write_shape

# The acceptance profile measured alongside the stock baseline in shared/device/README.md.
DEFAULT_RATES = "0.8,0.62,0.48,0.37,0.28,0.21,0.16"

ARMS = {
    "nospec": None,
    "dspark": {},
    "dspark-fp8": {"dspark_fp8_draft_head": True},
    "dspark-fp8-markov": {"dspark_fp8_draft_head": True, "dspark_fp8_markov_head": True},
    # vLLM's Dynamic SD: k by batch size (inclusive ranges).
    "dynamic-sd": {
        "num_speculative_tokens_per_batch_size": [[1, 16, 7], [17, 64, 3], [65, 4096, 1]]
    },
    "budget": {
        "dspark_capacity": "budget",
        "dspark_budget_frac": 0.5,
        "dspark_varlen_verify": True,
    },
    "threshold": {
        "dspark_capacity": "threshold",
        "dspark_confidence_threshold": 0.5,
        "dspark_varlen_verify": True,
    },
    # dspark_sps_curve: --sps-curve, else auto (profiled at start-up).
    "sps": {"dspark_capacity": "sps", "dspark_varlen_verify": True},
    "sps-depth": {
        "dspark_capacity": "sps",
        "dspark_varlen_verify": True,
        "dspark_dynamic_depth": True,
    },
    "acceptance": {"dspark_capacity": "acceptance", "dspark_varlen_verify": True},
    # DFlash (no confidence head): fixed depth, and the acceptance-length controller.
    "dflash": {"method": "dflash"},
    "dflash-acceptance": {
        "method": "dflash",
        "dspark_capacity": "acceptance",
        "dspark_varlen_verify": True,
    },
}


def conditional_rates(unconditional: list[float]) -> list[float]:
    """P(draft k accepted | drafts before it were) from P(drafts 1..k accepted)."""
    return [u / (unconditional[k - 1] if k else 1.0) for k, u in enumerate(unconditional)]


def run_arm_here(spec: dict) -> None:
    """In the arm's own process: one engine, every concurrency, one JSON line each."""
    from vllm import LLM, SamplingParams

    from vllm_dspark.metrics import AdmissionCounts, SpecDecodeCounts, admission_counts

    speculative = None
    if spec["options"] is not None:
        options = dict(spec["options"])
        method = options.pop("method", "dspark")
        draft = spec["draft"] if method == "dspark" else spec["dflash"]
        speculative = {"method": method, "model": draft, "num_speculative_tokens": 7}
        if spec["dummy"]:
            rates = [float(r) for r in spec["rates"].split(",")][:7]
            if spec["acceptance"] == "confidence" and method == "dspark":
                speculative["dspark_synthetic_confidence"] = conditional_rates(rates)
            else:
                speculative |= {
                    "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": rates,
                }
        speculative |= options
        # admission_counts() reads the speculator's counters in the worker.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = LLM(
        model=spec["target"],
        load_format="dummy" if spec["dummy"] else "auto",
        skip_tokenizer_init=spec["dummy"],
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=256,
        gpu_memory_utilization=0.85,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)

    def prompts(count: int, offset: int):
        return [
            {
                "prompt_token_ids": [
                    3 + (13 * i + j + offset) % 4000 for j in range(spec["prompt_len"])
                ]
            }
            for i in range(count)
        ]

    llm.generate(prompts(8, 0), params, use_tqdm=False)
    speculating = speculative is not None

    def admission() -> AdmissionCounts:
        return admission_counts(llm) if speculating else AdmissionCounts()

    for concurrency in spec["concurrency"]:
        before = SpecDecodeCounts.from_metrics(llm.get_metrics())
        admitted_before = admission()
        start = time.perf_counter()
        outputs = llm.generate(prompts(concurrency, concurrency), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before
        admitted = admission() - admitted_before
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        print(
            "ROW "
            + json.dumps(
                {
                    "concurrency": concurrency,
                    "tok_s": round(tokens / seconds, 1),
                    "acceptance_length": counts.acceptance_length if counts.drafts else None,
                    # Per request and step, compacted steps only (else all K).
                    "admitted_per_req": admitted.admitted_per_request if speculating else None,
                    "admission": asdict(admitted),
                    "spec_decode": asdict(counts),
                }
            ),
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="embedded", choices=["embedded", *SHAPES])
    parser.add_argument("--arms", default="nospec,dspark")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", default=DEFAULT_RATES)
    parser.add_argument("--acceptance", choices=["rates", "confidence"], default="rates")
    parser.add_argument("--sps-curve", help="curve JSON for the sps arm (default: auto)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm-spec", help=argparse.SUPPRESS)  # the per-arm subprocess
    args = parser.parse_args()
    if args.arm_spec:
        run_arm_here(json.loads(args.arm_spec))
        return 0

    if args.pair == "embedded":
        from vllm_dspark.demo import EMBEDDED_PAIR

        paths = {name: str(EMBEDDED_PAIR / name) for name in ("target", "draft")}
        paths["dflash"] = None  # the embedded pair has no DFlash drafter
    else:
        paths = write_shape(args.pair, Path(tempfile.mkdtemp()))
    rows = []
    for arm in args.arms.split(","):
        options = ARMS[arm]
        if arm.startswith("sps") and args.sps_curve:
            options = options | {"dspark_sps_curve": str(Path(args.sps_curve).resolve())}
        spec = {
            **paths,
            "dummy": args.pair != "embedded",
            "acceptance": args.acceptance,
            "options": options,
            "rates": args.rates,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": [int(c) for c in args.concurrency.split(",")],
        }
        done = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--arm-spec", json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        for line in done.stdout.splitlines():
            if line.startswith("ROW "):
                setup = args.pair if args.pair == "embedded" else f"{args.pair}/{args.acceptance}"
                rows.append({"setup": setup, "arm": arm, **json.loads(line[4:])})
                print(json.dumps(rows[-1]), flush=True)
    import torch

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
