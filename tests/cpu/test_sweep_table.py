"""tools/sweep_table.py: a sweep record as a markdown table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from sweep_table import drafts_per_request, sweep_table  # noqa: E402


def test_a_table_shows_every_run_and_takes_ratios_over_the_mean():
    def row(arm, c, tok_s, acceptance=None, admitted=None):
        return {
            "arm": arm,
            "concurrency": c,
            "tok_s": tok_s,
            "acceptance_length": acceptance,
            "admitted_per_req": admitted,
        }

    rows = [
        row("nospec", 1, 600.0),
        row("dspark", 1, 1000.0, 3.0, 7.0),
        row("dspark", 16, 8000.0, 3.1, 7.0),
        row("sps", 1, 1100.0, 3.0, 6.0),
        row("sps", 1, 1300.0, 3.2, 7.0),  # a mirrored engine's second pass
        row("nospec", 1, 700.0),  # bracketed: run again last
    ]
    table = sweep_table(rows, over="dspark").splitlines()
    assert table[:2] == ["| arm | 1 | 16 |", "| --- | --- | --- |"]
    assert table[2] == "| nospec | 600 / 700 (0.65x) |  |"
    assert table[3] == "| dspark | 1,000 (3.00, 7.0) | 8,000 (3.10, 7.0) |"
    assert table[4] == "| sps | 1,100 / 1,300 (1.20x, 3.10, 6.5) |  |"


def test_drafts_per_request_reads_vllm_where_nothing_was_compacted():
    # Dynamic SD at 256 requests: 3 drafts a request by its table, all verified; the
    # plugin's admission saw no compacted step and counts K.
    dynamic = {"admitted_per_req": 7.0, "admission": {"steps": 0}}
    dynamic["spec_decode"] = {"drafts": 1000, "draft_tokens": 3000}
    assert drafts_per_request(dynamic) == 3.0
    # A gate closed for most steps: the plugin's compacted steps are what it verified.
    gated = {"admitted_per_req": 0.86, "admission": {"steps": 50}}
    gated["spec_decode"] = {"drafts": 10630, "draft_tokens": 9838}
    assert drafts_per_request(gated) == 0.86
    assert drafts_per_request({"admitted_per_req": None}) is None  # no speculation
