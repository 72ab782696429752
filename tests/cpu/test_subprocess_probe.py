"""The GPU tests' probe runner tells a probe that hung on its way out (after reporting, as
vLLM's engine shutdown can) from one that never reported, and leaves no process behind."""

import os

import pytest
from subprocess_probe import MARKER, run_probe

REPORTS_THEN_HANGS = f"""
import os, time
print("{MARKER}" + '{{"ok": true}}', flush=True)
open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("body", "where"),
    [(REPORTS_THEN_HANGS, "after printing its result"), ("import time; time.sleep(60)", "before")],
)
def test_a_probe_past_its_timeout_says_whether_it_had_reported(tmp_path, monkeypatch, body, where):
    script = tmp_path / "probe.py"
    script.write_text(body)
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("PID_FILE", str(pid_file))
    with pytest.raises(TimeoutError, match=where):
        run_probe(script, timeout=3)
    if pid_file.exists():  # killed with its process group
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_a_probe_that_reports_and_exits_returns_its_result(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(f'print("{MARKER}" + \'{{"answer": 42}}\')')
    assert run_probe(script, timeout=30) == {"answer": 42}
