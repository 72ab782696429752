"""A sweep record (``benchmarks/offline_sweep.py``) as the README's markdown table.

    python tools/sweep_table.py benchmarks/results/capacity_sweep.json --setup embedded \
        --over dspark

One row per arm, in the record's order, one column per concurrency. A cell: tokens per
second, then (over the ``--over`` arm, acceptance length, drafts verified per request)
where known. An arm run more than once (no speculation first and last, ``--bracket``; a
mirrored engine's two passes, ``--mirror``; two engines of one arm, ``--lockstep``) shows
each run, "first / last", and its ratios use the mean, as ``tools/targets_summary.py``
counts it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from targets_summary import mean_tok_s


def drafts_per_request(row: dict) -> float | None:
    """Drafts a request verified per step: the plugin's count over its compacted steps, or,
    where none was compacted (stock k=7, Dynamic SD, every draft verified), vLLM's draft
    tokens per drafting request; the plugin counts K there, which Dynamic SD's table cuts."""
    if (row.get("admission") or {}).get("steps"):
        return row["admitted_per_req"]
    counts = row.get("spec_decode") or {}
    if counts.get("drafts"):
        return counts["draft_tokens"] / counts["drafts"]
    return row.get("admitted_per_req")


def _cell(rows: list[dict], ratio: float | None) -> str:
    runs = " / ".join(f"{row['tok_s']:,.0f}" for row in rows)
    notes = [] if ratio is None else [f"{ratio:.2f}x"]
    acceptance = [row["acceptance_length"] for row in rows if row.get("acceptance_length")]
    if acceptance:
        notes.append(f"{statistics.fmean(acceptance):.2f}")
    admitted = [value for value in map(drafts_per_request, rows) if value]
    if admitted:
        notes.append(f"{statistics.fmean(admitted):.1f}")
    return runs + (f" ({', '.join(notes)})" if notes else "")


def sweep_table(rows: list[dict], over: str | None = None) -> str:
    """The markdown table of ``rows`` (one setup's)."""
    by_arm: dict[str, dict[int, list[dict]]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], {}).setdefault(row["concurrency"], []).append(row)
    means = mean_tok_s(rows)
    concurrencies = sorted({row["concurrency"] for row in rows})
    lines = [
        "| arm | " + " | ".join(map(str, concurrencies)) + " |",
        "| --- |" + " --- |" * len(concurrencies),
    ]
    for arm, cells in by_arm.items():
        values = []
        for c in concurrencies:
            reference = means.get((over, c)) if over and arm != over else None
            ratio = means[(arm, c)] / reference if reference and c in cells else None
            values.append(_cell(cells[c], ratio) if c in cells else "")
        lines.append(f"| {arm} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--setup", help="only this setup's rows (capacity_sweep.json has two)")
    parser.add_argument("--over", help="the arm every ratio is taken over")
    args = parser.parse_args()
    rows = json.loads(args.record.read_text())["rows"]
    if args.setup:
        rows = [row for row in rows if row.get("setup") == args.setup]
    print(sweep_table(rows, args.over))
    return 0


if __name__ == "__main__":
    sys.exit(main())
