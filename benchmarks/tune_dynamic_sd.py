"""vLLM's Dynamic SD table (batch size -> number of drafts) from measured fixed-k rows.

    python benchmarks/tune_dynamic_sd.py benchmarks/results/step_breakdown.json \
        benchmarks/results/step_breakdown_k7.json \
        benchmarks/results/fixed_k3_graphs1024_5b1d70a.json \
        benchmarks/results/capacity_qwen3_cut_e38413b_h100.json \
        --out benchmarks/results/dynamic_sd_table.json

Reads step-breakdown JSONs (rows of arm ``nospec`` and ``dspark-kN``: decode throughput,
requests x acceptance length over the median step) and offline-sweep JSONs (rows of arm
``nospec`` and ``dspark``, K from the row's ``admission``: end-to-end tokens per second).
Each fixed-k row counts as a ratio to the no-speculation row of the same record and
concurrency, so records of different runs and machines compare; a later record's ratio
for the same (concurrency, k) replaces an earlier one's. At each measured concurrency the
k with the best ratio wins (no speculation where none beats it: k = 0 is not a Dynamic SD
entry, so it becomes k = 1, the cheapest); between two measured concurrencies the boundary
sits at their geometric mean. Writes ``num_speculative_tokens_per_batch_size``
([[first, last, k], ...]) with the ratios it chose from; ``offline_sweep.py``'s
``dynamic-sd`` arm runs that table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from pathlib import Path

FIXED_ARM = re.compile(r"dspark-k(\d+)$")
MAX_BATCH = 4096


def fixed_k_ratios(records: list[dict]) -> dict[int, dict[int, float]]:
    """{concurrency: {k: throughput over no speculation's, same record}}."""
    ratios: dict[int, dict[int, float]] = {}
    for record in records:
        rows = record["rows"]
        baseline = {r["concurrency"]: throughput(r) for r in rows if r["arm"] == "nospec"}
        for row in rows:
            k = fixed_k(row)
            if k and row["concurrency"] in baseline:
                ratio = throughput(row) / baseline[row["concurrency"]]
                ratios.setdefault(row["concurrency"], {})[k] = ratio
    return ratios


def fixed_k(row: dict) -> int | None:
    """K of a stock fixed-depth row: a breakdown's ``dspark-kN`` or a sweep's ``dspark``."""
    match = FIXED_ARM.match(row["arm"])
    if match:
        return int(match.group(1))
    return row["admission"]["num_drafts"] if row["arm"] == "dspark" else None


def throughput(row: dict) -> float:
    """A sweep row's tokens per second; a breakdown row's decode tokens per second
    (requests x acceptance length over the median step)."""
    if row.get("decode_tok_s"):
        return row["decode_tok_s"]
    if "step_ms_median" in row:  # breakdowns from before decode_tok_s was recorded
        acceptance = row.get("acceptance_length") or 1.0
        return row["concurrency"] * acceptance * 1e3 / row["step_ms_median"]
    return row["tok_s"]


def table_from_ratios(ratios: dict[int, dict[int, float]]) -> list[list[int]]:
    """[[first batch size, last batch size, k], ...] covering 1..MAX_BATCH."""
    measured = sorted(ratios)
    best = [max(ratios[c], key=ratios[c].get) for c in measured]
    best = [k if ratios[c][k] > 1.0 else 1 for c, k in zip(measured, best, strict=True)]
    table, first = [], 1
    for i, k in enumerate(best):
        last = MAX_BATCH
        if i + 1 < len(measured):
            last = math.floor(math.sqrt(measured[i] * measured[i + 1]))
        if table and table[-1][2] == k:
            table[-1][1] = last
        else:
            table.append([first, last, k])
        first = last + 1
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("breakdowns", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [json.loads(path.read_text()) for path in args.breakdowns]
    ratios = fixed_k_ratios(records)
    if not ratios:
        print("no fixed-k rows beside no-speculation rows", file=sys.stderr)
        return 1
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "note": "derived on a CPU from the records it names (Qwen3-8B shape): step "
        "breakdowns give decode ratios, sweeps end-to-end ones",
        "from": [
            {"file": str(p), "commit": r.get("commit")}
            for p, r in zip(args.breakdowns, records, strict=True)
        ],
        "ratio_over_no_speculation": {
            str(c): {str(k): round(v, 3) for k, v in sorted(ks.items())}
            for c, ks in sorted(ratios.items())
        },
        "num_speculative_tokens_per_batch_size": table_from_ratios(ratios),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["num_speculative_tokens_per_batch_size"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
