"""Run a test file's ``interpreted`` tests under Triton's interpreter, in a subprocess.

The interpreter must be on before ``triton`` is first imported, so those tests cannot run
in the parent pytest process: they are skipped there (:data:`interpreted`) and run by one
test per file through :func:`run_interpreted`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="run under Triton's interpreter by its file's subprocess test"
)


def run_interpreted(test_file: str) -> int:
    """Run ``test_file -k interpreted`` with TRITON_INTERPRET=1; returns how many passed
    (fails the calling test on any failure or skip)."""
    if INTERPRETED:
        pytest.skip("this is the interpreter subprocess")
    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parents[1]
    # No visible GPU reads to vLLM as a distributed worker before CUDA is up: it keeps its
    # Triton kernels (without a driver it would replace them with stubs).
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        command + ["-k", "interpreted"], env=env, cwd=repo, capture_output=True, text=True
    )
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert " skipped" not in done.stdout, report
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed, report
    return int(passed.group(1))
