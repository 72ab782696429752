"""Reading compute-sanitizer's memcheck log (tests/gpu/test_sanitizer_gpu.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from test_sanitizer_gpu import error_count  # noqa: E402


def test_error_summaries_of_every_followed_process_are_summed():
    log = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at _compact_kernel+0x1c0
========= ERROR SUMMARY: 1 error
========= ERROR SUMMARY: 0 errors
========= ERROR SUMMARY: 2 errors
"""
    assert error_count(log) == 3
    assert error_count("========= ERROR SUMMARY: 0 errors\n") == 0


def test_a_log_without_a_summary_is_a_failure_not_a_pass():
    with pytest.raises(AssertionError):
        error_count("the sanitizer never finished")


def test_a_process_memcheck_never_attached_to_is_not_checked():
    from test_sanitizer_gpu import checked

    # The log of the probe's process on the H200 at 5ba4c5a.
    cut = Path(__file__).resolve().parents[2] / "benchmarks/results/memcheck_5ba4c5a_cut.log"
    assert not checked(cut.read_text())
    unattached_but_summarised = cut.read_text() + "========= ERROR SUMMARY: 0 errors\n"
    assert not checked(unattached_but_summarised)
    assert checked("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    assert not checked("========= COMPUTE-SANITIZER\n")  # cut before its end
