"""tools/depth_sts_summary.py: the depth / DFlash / online-STS targets from the GPU records."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from depth_sts_summary import summarize  # noqa: E402

RECORD = {"commit": "abc", "date": "d", "device": "H200"}


def write(directory: Path, name: str, body: dict) -> None:
    (directory / name).write_text(json.dumps(RECORD | body))


def sweep_rows(setup: str, tok_s: dict) -> list[dict]:
    return [
        {"setup": setup, "arm": arm, "concurrency": c, "tok_s": value}
        for (arm, c), value in tok_s.items()
    ]


def test_every_target_is_checked_from_its_record(tmp_path):
    depth = [
        {"concurrency": c, "depth": d, "draft_ms": ms}
        for c, d, ms in [(256, 2, 3.5), (256, 7, 6.5), (64, 2, 1.1), (64, 7, 1.9)]
    ]
    write(tmp_path, "depth_time.json", {"rows": depth})
    setup = "qwen3-8b/confidence"
    current = {("sps", 64): 100.0, ("sps-depth", 64): 110.0, ("nospec", 64): 50.0}
    current |= {("sps", 256): 200.0, ("sps-depth", 256): 190.0, ("threshold", 256): 150.0}
    # The other setup's run, listed first (as in the file), must not count.
    rows = sweep_rows("embedded", {("nospec", 64): 999.0, ("nospec", 256): 999.0})
    rows += sweep_rows(setup, current)
    runs = [{"commit": "old", "setup": "embedded"}, {"commit": "new", "setup": setup}]
    write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
    dflash = {(arm, c): 100.0 for arm in ("dflash", "nospec") for c in (1, 16, 64, 256)}
    dflash |= {("dflash-acceptance", c): 101.0 for c in (1, 16, 64, 256)}
    dflash |= {("dflash-plain", c): 99.0 for c in (1, 16, 64, 256)}
    dflash_rows = sweep_rows(setup, dflash)
    for row in dflash_rows:
        if row["concurrency"] == 256 and row["arm"] in ("nospec", "dflash-acceptance"):
            row["tok_s_repeats"] = [row["tok_s"] - 1, row["tok_s"], row["tok_s"] + 5]
    write(tmp_path, "dflash_acceptance.json", {"rows": dflash_rows})
    evaluation = {"steps_before": 1800, "ece": [0.02, 0.031], "max_ece": 0.031}
    write(
        tmp_path,
        "online_sts.json",
        {"evaluation": evaluation, "greedy_identical": True, "greedy_identical_prompts": 200},
    )
    entries, missing = summarize(tmp_path)
    assert missing == []
    depth_entry, gain, dflash_entry, sts = entries
    assert depth_entry["passes"] and abs(depth_entry["measured"]["ratio"] - 3.5 / 6.5) < 1e-9
    assert gain["passes"] is None  # a measurement, not a threshold
    assert gain["measured"]["64"]["gain"] == 1.1
    assert gain["evidence"]["commit"] == "new"  # setup (b)'s run, not the file's or (a)'s
    assert gain["measured"]["256"] | {"gain": 0} == {
        "sps_depth": 190.0,
        "best_other_arm": "sps",
        "best_other": 200.0,
        "gain": 0,
    }
    # The plain-steps arm misses (0.99x); the other passes, so the target does.
    assert dflash_entry["passes"]
    assert dflash_entry["measured"]["dflash-acceptance"]["over_nospec_256"] == 1.01
    assert dflash_entry["measured"]["dflash-plain"]["over_fixed"]["1"] == 0.99
    assert dflash_entry["measured"]["dflash-acceptance"]["repeats_256"] == {
        "dflash-acceptance": [100.0, 101.0, 106.0],
        "nospec": [99.0, 100.0, 105.0],
    }
    assert "repeats_256" not in dflash_entry["measured"]["dflash-plain"]  # none recorded
    assert not sts["passes"]  # position 2's ECE is 0.031
    assert sts["evidence"] == {"file": "benchmarks/results/online_sts.json"} | RECORD


def test_a_missing_record_leaves_its_target_unmeasured(tmp_path):
    entries, missing = summarize(tmp_path)
    assert len(missing) == 4
    assert all(entry["passes"] is None and entry["measured"] is None for entry in entries)
