"""Put a setup's newest run into ``capacity_sweep.json``: the rows of one or more sweep
records (``benchmarks/offline_sweep.py --out``) replace that setup's rows, and one entry
of ``runs`` names their commands, commit, date, device and records.

    python tools/sweep_setup.py benchmarks/results/capacity_sweep.json --setup embedded \
        benchmarks/results/capacity_lockstep_embedded_55bf4da_h100_1_256.json ...

Several records make one run only if one commit on one kind of device measured them (a
lockstep run split over concurrencies on one warm machine); each row keeps what the
tables and ``tools/targets_summary.py`` read, not its batch's timeline or gate state,
which stay in the record. The run takes the place of the setup's old entry in ``runs``;
the file's ``note``, which says how each run was measured, is left to edit by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROW_KEYS = (
    "setup",
    "arm",
    "copy",
    "concurrency",
    "tok_s",
    "tok_s_repeats",
    "acceptance_length",
    "admitted_per_req",
    "mean_ttft_s",
    "bracket",
    "pass",
    "lockstep",
    "paired",
    "admission",
    "spec_decode",
)


def sweep_setup(sweep: dict, setup: str, records: dict[str, dict]) -> dict:
    """``sweep`` with ``setup``'s rows and run replaced by those of ``records`` (by file
    name, in the order given)."""
    agreed = {key: {record[key] for record in records.values()} for key in ("commit", "device")}
    for key, values in agreed.items():
        if len(values) > 1:
            raise ValueError(f"one run has one {key}; these records have {sorted(values)}")
    rows = [
        {key: row[key] for key in ROW_KEYS if key in row} | {"setup": setup}
        for record in records.values()
        for row in record["rows"]
    ]
    run = {
        "command": " ; ".join(record["command"] for record in records.values()),
        "commit": agreed["commit"].pop(),
        "date": min(record["date"] for record in records.values()),
        "device": agreed["device"].pop(),
        "setup": setup,
        "record": " + ".join(records),
    }
    runs = sweep.get("runs", [])
    index = next((i for i, old in enumerate(runs) if old.get("setup") == setup), len(runs))
    return sweep | {
        "runs": [*runs[:index], run, *runs[index + 1 :]],
        "rows": rows + [row for row in sweep["rows"] if row.get("setup") != setup],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="capacity_sweep.json, rewritten in place")
    parser.add_argument("--setup", required=True, help="e.g. embedded, qwen3-8b/confidence")
    parser.add_argument("records", type=Path, nargs="+")
    args = parser.parse_args()
    records = {path.name: json.loads(path.read_text()) for path in args.records}
    sweep = sweep_setup(json.loads(args.sweep.read_text()), args.setup, records)
    args.sweep.write_text(json.dumps(sweep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
