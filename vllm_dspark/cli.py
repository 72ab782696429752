"""The `vllm-dspark` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-dspark", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="report versions, options and whether DSpark can run")
    demo = commands.add_parser("demo", help="run the embedded model pair without and with DSpark")
    demo.add_argument("--prompts", type=int, default=200, help="held-out prompts to run")
    demo.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    demo.add_argument("--k", type=int, default=7, help="drafts per step")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    demo.add_argument("--plot", metavar="FILE", help="write a PNG of per-position acceptance")
    demo.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from vllm_dspark.doctor import run_doctor

        run_doctor()  # a report: it succeeds whatever it finds
        return 0
    if args.command == "demo":
        from vllm_dspark.demo import run_demo

        return run_demo(
            num_prompts=args.prompts,
            max_tokens=args.max_tokens,
            k=args.k,
            dtype=args.dtype,
            plot=args.plot,
            json_out=args.json,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
