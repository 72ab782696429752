"""Collect the hardening reproducers' results into one list, one entry per case.

    python tools/hardening_summary.py RESULTS_DIR --out benchmarks/results/hardening.json

RESULTS_DIR holds what the GPU tests wrote (``tools/device/gpu_stage.sh hardening``; each
file may sit in a folder of its own): ``prefix_cache.json`` (case 1),
``freed_memory.json`` (cases 2 and 3: one run poisons every byte a freed or padded read
could reach), ``draft_slots.json`` (case 4) and ``soak.json`` (case 5). Each entry is
{case, stock_fails, plugin_passes, evidence}; a case whose file is missing is left out and
named on standard error, never guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CASES = [
    ("prefix-cache-restored prefixes", "prefix_cache.json"),
    ("CUDA-graph buffer lifetime", "freed_memory.json"),
    ("padded replay state", "freed_memory.json"),
    ("stale draft-slot writes", "draft_slots.json"),
    ("soak: 2,000 requests, preemption, aborts, every option", "soak.json"),
]


def summarize(results_dir: Path) -> tuple[list[dict], list[str]]:
    """(one entry per case found, the files not found)."""
    found = {path.name: path for path in sorted(results_dir.rglob("*.json"))}
    entries, missing = [], []
    for case, filename in CASES:
        if filename not in found:
            missing.append(filename)
            continue
        record = json.loads(found[filename].read_text())
        entries.append(
            {
                "case": case,
                "stock_fails": record["stock_fails"],
                "plugin_passes": record["plugin_passes"],
                "evidence": {
                    "file": f"benchmarks/results/{filename}",
                    **{key: record[key] for key in ("commit", "date", "device", "setup")},
                    "stock": record["stock"],
                    "plugin": record["plugin"],
                },
            }
        )
    return entries, sorted(set(missing))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    entries, missing = summarize(args.results_dir)
    if missing:
        print(f"not found, cases left out: {', '.join(missing)}", file=sys.stderr)
    args.out.write_text(json.dumps(entries, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
