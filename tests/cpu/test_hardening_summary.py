"""tools/hardening_summary.py: one entry per hardening case, from the GPU tests' files."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from hardening_summary import CASES, add_sanitizer, summarize  # noqa: E402


def write(path: Path, stock_fails: bool, plugin_passes: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"commit": "abc", "date": "d", "device": "H200", "setup": "s"}
    record |= {"stock_fails": stock_fails, "plugin_passes": plugin_passes}
    path.write_text(json.dumps(record | {"stock": {"x": 1}, "plugin": {"x": 2}}))


def test_each_case_reads_its_file_wherever_the_stage_put_it(tmp_path):
    write(tmp_path / "prefix" / "prefix_cache.json", stock_fails=False, plugin_passes=True)
    write(tmp_path / "freed" / "freed_memory.json", stock_fails=True, plugin_passes=True)
    write(tmp_path / "soak.json", stock_fails=False, plugin_passes=False)
    entries, missing = summarize(tmp_path)
    assert missing == ["draft_slots.json"]
    by_case = {entry["case"]: entry for entry in entries}
    assert len(entries) == len(CASES) - 1  # cases 2 and 3 share the freed-memory run
    assert by_case["CUDA-graph buffer lifetime"]["stock_fails"] is True
    assert by_case["padded replay state"]["evidence"]["file"].endswith("freed_memory.json")
    soak = next(entry for entry in entries if entry["case"].startswith("soak"))
    assert soak["plugin_passes"] is False and soak["evidence"]["plugin"] == {"x": 2}


def test_a_sanitizer_run_joins_case_two_and_fails_it_unless_checked_and_clean(tmp_path):
    write(tmp_path / "freed_memory.json", stock_fails=False, plugin_passes=True)
    run = {"commit": "abc", "date": "d", "device": "H200", "setup": "s", "compacted_steps": 16}
    for log_checked, errors, passes in [(True, 0, True), (True, 2, False), (False, None, False)]:
        entries, _ = summarize(tmp_path)
        sanitizer = tmp_path / "sanitizer_abc.json"
        sanitizer.write_text(json.dumps(run | {"log_checked": log_checked, "errors": errors}))
        add_sanitizer(entries, sanitizer)
        lifetime = next(entry for entry in entries if entry["case"] == "CUDA-graph buffer lifetime")
        assert lifetime["plugin_passes"] is passes
        assert lifetime["evidence"]["sanitizer"]["file"] == "benchmarks/results/sanitizer_abc.json"
        padded = next(entry for entry in entries if entry["case"] == "padded replay state")
        assert "sanitizer" not in padded["evidence"]
