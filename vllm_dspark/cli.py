"""The `vllm-dspark` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-dspark", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="report versions, options and whether DSpark can run")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from vllm_dspark.doctor import run_doctor

        run_doctor()  # a report: it succeeds whatever it finds
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
