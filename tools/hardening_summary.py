"""Collect the hardening reproducers' results into one list, one entry per case.

    python tools/hardening_summary.py RESULTS_DIR --out benchmarks/results/hardening.json

RESULTS_DIR holds what the GPU tests wrote (``tools/device/gpu_stage.sh hardening``; each
file may sit in a folder of its own): ``prefix_cache.json`` (case 1),
``freed_memory.json`` (cases 2 and 3: one run poisons every byte a freed or padded read
could reach), ``draft_slots.json`` (case 4) and ``soak.json`` (case 5). Each entry is
{case, stock_fails, plugin_passes, evidence}; a case whose file is missing is left out and
named on standard error, never guessed. ``--sanitizer FILE`` adds a compute-sanitizer run
(``tests/gpu/test_sanitizer_gpu.py``, the plugin alone) to case 2's evidence.
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


SANITIZER_CASE = "CUDA-graph buffer lifetime"


def add_sanitizer(entries: list[dict], path: Path) -> None:
    """Adds a memcheck run to case 2's evidence; the case passes only if memcheck checked
    the engine's process to its end and found no error."""
    record = json.loads(path.read_text())
    entry = next(entry for entry in entries if entry["case"] == SANITIZER_CASE)
    keys = ("commit", "date", "device", "setup", "errors", "log_checked", "compacted_steps")
    entry["evidence"]["sanitizer"] = {
        "file": f"benchmarks/results/{path.name}",
        **{key: record.get(key) for key in keys},
    }
    clean = record.get("log_checked") is True and record.get("errors") == 0
    entry["plugin_passes"] = entry["plugin_passes"] and clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sanitizer", type=Path, help="a sanitizer.json to add to case 2")
    args = parser.parse_args()
    entries, missing = summarize(args.results_dir)
    if args.sanitizer is not None:
        add_sanitizer(entries, args.sanitizer)
    if missing:
        print(f"not found, cases left out: {', '.join(missing)}", file=sys.stderr)
    args.out.write_text(json.dumps(entries, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
