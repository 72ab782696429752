"""On a GPU, with the embedded pair: compute-sanitizer's memcheck over a short run with
every capacity option (hardening case 2: no kernel reads or writes memory it does not own).

The run is small (4 prompts, 24 tokens, max_num_seqs 4, so few CUDA graphs are captured,
and 256 tokens per step at most, so vLLM's start-up dummy forward is small too), without
torch.compile (FULL decode graphs of the eager model), in float32, with vLLM's engine
core in the probe's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): memcheck did not
follow the engine core vLLM forks (H200, c6d6210: no log from it), and one instrumented
process sees every kernel: vLLM's, the compact verification graphs' and the plugin's
Triton kernels. The
caching allocator stays on (CUDA graphs need it), so memcheck sees accesses outside live
allocations, not reuse inside the allocator's pool: that is what the freed-memory test
(tests/gpu/test_freed_memory_gpu.py) covers. Skipped where the machine has no
compute-sanitizer; set DSPARK_RESULTS_DIR to also write ``sanitizer.json`` there.
"""

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_options import EVERY_CAPACITY_OPTION
from gpu_results import write_result
from pair_probe import LLM_PROBE, pair_spec
from subprocess_probe import run_probe

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def usable_sanitizer() -> tuple[str | None, str]:
    """(compute-sanitizer's path, or None with why not). Some machines have the tool but
    it refuses their GPU (gVisor: "Device not supported"): it must run a CUDA allocation."""
    found = shutil.which("compute-sanitizer")
    found = found or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))), None)
    if found is None:
        return None, "no compute-sanitizer on this machine"
    check = [found, "--tool=memcheck", sys.executable, "-c"]
    check.append("import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()")
    done = subprocess.run(check, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0 or "ERROR SUMMARY: 0 errors" not in done.stdout:
        return None, f"compute-sanitizer does not run here: {(done.stdout + done.stderr)[-300:]}"
    return found, ""


# What memcheck writes when a process did not connect within --launch-timeout: it then
# lets the process run unchecked (5ba4c5a, H200: the probe's own process, whose children
# then went unfollowed, and a single log with "ERROR SUMMARY: 0 errors" at 0437bee).
UNATTACHED = "No attachable process found"


def checked(log: str) -> bool:
    """Whether memcheck instrumented the processes of this log to their end."""
    return UNATTACHED not in log and "ERROR SUMMARY" in log


def error_count(log: str) -> int:
    """memcheck's "ERROR SUMMARY: N errors" (summed, should a log hold several)."""
    counts = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    assert counts, log[-3000:]
    return sum(map(int, counts))


def test_memcheck_finds_no_error_with_every_capacity_option(tmp_path: Path, monkeypatch):
    sanitizer, why_not = usable_sanitizer()
    if sanitizer is None:
        write_result(
            "sanitizer.json",
            "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_sanitizer_gpu.py",
            {"available": False, "why": why_not},
        )
        pytest.skip(why_not)
    # Beside the results when they are collected: a run cut short still shows how far it got.
    # %p is compute-sanitizer's own pid: every process it follows writes to this one log
    # (H200, 5e59c9b: memcheck.835.log, the engine in process 844).
    log_dir = Path(os.environ.get("DSPARK_RESULTS_DIR", tmp_path))
    prefix = (
        sanitizer,
        "--tool=memcheck",
        "--target-processes=all",
        # Seen on the H200 (5ba4c5a): the default 10 s passed before a process importing
        # vLLM connected. Processes that never touch CUDA (vLLM's helpers) are not errors.
        "--launch-timeout=300",
        "--require-cuda-init=no",
        "--print-limit=20",
        f"--log-file={log_dir / 'memcheck.%p.log'}",
    )
    spec = pair_spec(
        EVERY_CAPACITY_OPTION,
        prompts=load_prompts(num_prompts=4),
        max_tokens=24,
        max_num_seqs=4,
        # vLLM's start-up dummy forward runs this many tokens, every kernel instrumented.
        max_num_batched_tokens=256,
        # No torch.compile: memcheck would instrument every kernel Inductor's autotuning
        # launches. The FULL decode graphs (vLLM's, the compact verification graphs, the
        # drafter's) are captured from the eager model and replayed all the same.
        compile=False,
    )
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the probe
    # Within the sanitizer stage's 1,200 s (tools/device/gpu_stage.sh).
    result = run_probe(LLM_PROBE, stdin=spec, prefix=prefix, timeout=1100)
    logs = [log.read_text() for log in log_dir.glob("memcheck.*.log")]
    assert len(logs) == 1, f"one compute-sanitizer run, one log: {len(logs)}"
    log = logs[0]
    errors = error_count(log) if checked(log) else None
    write_result(
        "sanitizer.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_sanitizer_gpu.py",
        {
            "setup": "embedded pair, 4 prompts, 24 tokens, max_num_seqs 4, float32, k=7, "
            "no torch.compile (FULL_DECODE_ONLY graphs), compute-sanitizer memcheck over "
            "every process, the engine core in the probe's process",
            "options": EVERY_CAPACITY_OPTION,
            "available": True,
            "sanitizer": sanitizer,
            "errors": errors,
            "log_checked": checked(log),
            "probe_pid": result["probe_pid"],
            "worker_pids": result["worker_pids"],
            "compacted_steps": result["admission"]["steps"],
            "log_tail": log[-4000:],
        },
    )
    assert result["admission"]["steps"] > 0  # the plugin's paths ran
    # Every kernel ran in the probe's process, which memcheck instrumented to its end (a
    # process it never attached to would run unchecked, and the summary would still print).
    assert result["worker_pids"] == [result["probe_pid"]]
    assert checked(log), log[-3000:]
    assert errors == 0, log[-8000:]
