"""vLLM's Dynamic SD table (batch size -> number of drafts) from measured fixed-k rows.

    cd benchmarks/results && python ../tune_dynamic_sd.py step_breakdown.json \
        step_breakdown_k7.json step_breakdown_graphs1024_a37526b.json \
        capacity_qwen3_b7ae06f_h100.json --out dynamic_sd_table.json

Reads step-breakdown JSONs (rows of arm ``nospec`` and ``dspark-kN``: decode throughput,
requests x acceptance length over the median step) and offline-sweep JSONs (rows of arm
``nospec`` and ``dspark``, K from the row's ``admission``: end-to-end tokens per second).
Each row counts as a ratio to the no-speculation row of the same record and concurrency,
so records of different runs and machines compare; a later record's ratio for the same
(concurrency, k) replaces an earlier one's.

The ratios are Dynamic SD's, not the fixed-k engines': under Dynamic SD the engine keeps
its K (``--num-drafts``, the sweep's 7) and vLLM's drafter computes all K drafts whatever
k the table gives the step; only the verification shrinks. A fixed-k row with k < K is
therefore charged the K-draft proposal: its step time less its own draft phase plus the
K row's at that concurrency (a breakdown's ``draft_graph``, or its eager backbone and
Markov/LM-head phases). A sweep's end-to-end row with k < K has no phases to charge and
is left out. (At 256 requests on the Qwen3-8B shape, b7ae06f, H100: fixed k=1 ran 1.06x
no speculation, Dynamic SD at k=1 0.90x.)

At each measured concurrency the k with the best ratio wins, below 1 or not: Dynamic SD
cannot switch speculation off, and its smallest k is not its cheapest step. Between two
measured concurrencies the boundary sits at their geometric mean. Writes
``num_speculative_tokens_per_batch_size`` ([[first, last, k], ...]) with the ratios it
chose from; ``offline_sweep.py``'s ``dynamic-sd`` arm runs that table.
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


def dynamic_sd_ratios(records: list[dict], engine_drafts: int) -> dict[int, dict[int, float]]:
    """{concurrency: {k: Dynamic SD's throughput at k over no speculation's, same record}}
    for an engine of ``engine_drafts`` drafts (the module's cost model)."""
    full_draft = {
        row["concurrency"]: draft_ms(row)
        for record in records
        for row in record["rows"]
        if fixed_k(row) == engine_drafts and draft_ms(row) is not None
    }
    ratios: dict[int, dict[int, float]] = {}
    for record in records:
        rows = record["rows"]
        baseline = {r["concurrency"]: throughput(r) for r in rows if r["arm"] == "nospec"}
        for row in rows:
            k, concurrency = fixed_k(row), row["concurrency"]
            if not k or k > engine_drafts or concurrency not in baseline:
                continue
            tok_s = throughput(row)
            if k < engine_drafts:
                tok_s = with_full_proposal(row, full_draft.get(concurrency))
            if tok_s is not None:
                ratios.setdefault(concurrency, {})[k] = tok_s / baseline[concurrency]
    return ratios


def draft_ms(row: dict) -> float | None:
    """A breakdown row's proposal time: its draft graph, or its eager draft phases."""
    phases = row.get("phases_ms") or {}
    if phases.get("draft_graph") is not None:
        return phases["draft_graph"]
    eager = [phases.get("draft_backbone"), phases.get("markov_lm_head")]
    return None if None in eager else sum(eager)


def with_full_proposal(row: dict, full_draft_ms: float | None) -> float | None:
    """Decode tokens per second of a breakdown row's step had its proposal computed all
    K drafts (``full_draft_ms``); None where a time is missing (a sweep row)."""
    own = draft_ms(row)
    if own is None or full_draft_ms is None or "step_ms_median" not in row:
        return None
    return decode_tok_s(row, row["step_ms_median"] - own + full_draft_ms)


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
        return decode_tok_s(row, row["step_ms_median"])
    return row["tok_s"]


def decode_tok_s(row: dict, step_ms: float) -> float:
    """A breakdown row's requests x acceptance length per step of ``step_ms``."""
    return row["concurrency"] * (row.get("acceptance_length") or 1.0) * 1e3 / step_ms


def table_from_ratios(ratios: dict[int, dict[int, float]]) -> list[list[int]]:
    """[[first batch size, last batch size, k], ...] covering 1..MAX_BATCH."""
    measured = sorted(ratios)
    best = [max(ratios[c], key=ratios[c].get) for c in measured]
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
    parser.add_argument("--num-drafts", type=int, default=7, help="the engine's K")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [json.loads(path.read_text()) for path in args.breakdowns]
    ratios = dynamic_sd_ratios(records, args.num_drafts)
    if not ratios:
        print("no fixed-k rows beside no-speculation rows", file=sys.stderr)
        return 1
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "note": "derived on a CPU from the records it names (Qwen3-8B shape): step "
        "breakdowns give decode ratios, sweeps end-to-end ones; a k below the engine's K "
        "is charged the K-draft proposal, as Dynamic SD runs it",
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
