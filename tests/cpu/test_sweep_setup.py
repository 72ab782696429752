"""tools/sweep_setup.py: a setup's newest run into capacity_sweep.json."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from sweep_setup import main, sweep_setup  # noqa: E402


def record(commit, date, concurrency, device="H100"):
    rows = [
        {"setup": "embedded", "arm": arm, "concurrency": concurrency, "tok_s": tok_s}
        | {"timeline": {"steps": [[0.0, 1, 1, 1, 0]]}, "paired": {}}
        for arm, tok_s in (("nospec", 10.0), ("sps", 20.0))
    ]
    command = f"offline_sweep.py --concurrency {concurrency}"
    return {"command": command, "commit": commit, "date": date, "device": device, "rows": rows}


def test_records_of_one_run_replace_the_setups_rows_and_run_in_place(monkeypatch, tmp_path):
    sweep = {
        "note": "kept",
        "runs": [{"setup": "embedded", "commit": "old"}, {"setup": "qwen3", "commit": "b"}],
        "rows": [
            {"setup": "embedded", "arm": "dspark", "concurrency": 1, "tok_s": 1.0},
            {"setup": "qwen3", "arm": "sps", "concurrency": 1, "tok_s": 2.0},
        ],
    }
    path = tmp_path / "capacity_sweep.json"
    path.write_text(json.dumps(sweep))
    files = []
    for name, date, c in (("a.json", "2026-12-06T16:06", 1), ("b.json", "2026-12-06T16:08", 16)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(record("55bf4da", date, c)))
    argv = ["sweep_setup.py", str(path), "--setup", "embedded", *map(str, files)]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    written = json.loads(path.read_text())
    assert written["note"] == "kept"
    assert written["runs"][1] == {"setup": "qwen3", "commit": "b"}
    assert written["runs"][0] == {
        "command": "offline_sweep.py --concurrency 1 ; offline_sweep.py --concurrency 16",
        "commit": "55bf4da",
        "date": "2026-12-06T16:06",
        "device": "H100",
        "setup": "embedded",
        "record": "a.json + b.json",
    }
    assert [(row["arm"], row["concurrency"]) for row in written["rows"]] == [
        ("nospec", 1),
        ("sps", 1),
        ("nospec", 16),
        ("sps", 16),
        ("sps", 1),  # the other setup's row, untouched
    ]
    assert "timeline" not in written["rows"][0] and "paired" in written["rows"][0]


def test_records_of_two_commits_or_devices_are_not_one_run():
    sweep = {"runs": [], "rows": []}
    with pytest.raises(ValueError, match="commit"):
        sweep_setup(sweep, "embedded", {"a": record("x", "d", 1), "b": record("y", "d", 16)})
    apart = {"a": record("x", "d", 1), "b": record("x", "d", 16, device="H200")}
    with pytest.raises(ValueError, match="device"):
        sweep_setup(sweep, "embedded", apart)
    added = sweep_setup(sweep, "embedded", {"a": record("x", "d", 1)})
    assert [run["setup"] for run in added["runs"]] == ["embedded"]
