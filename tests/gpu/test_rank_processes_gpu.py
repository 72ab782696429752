"""On one GPU: two processes stand in for two tensor-parallel ranks (hardening of the
tensor-parallelism issue where no multi-GPU machine is lent).

Under tensor parallelism every rank decides its capacities, depths and temperatures by
itself from identical inputs, so those decisions must not depend on anything a rank has of
its own: its Python hash seed, what its caching allocator held before, when its kernels
ran beside the other rank's. Both processes run ``rank_probe.py`` at once on the same GPU,
with different hash seeds and free memory poisoned with different bytes, and must agree on
every step's decisions bit for bit, while those decisions move (depths change, STS refits).

Set DSPARK_RESULTS_DIR to also write ``rank_processes.json`` there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_results import write_result
from subprocess_probe import MARKER

pytestmark = pytest.mark.gpu
PROBE = Path(__file__).with_name("rank_probe.py")


def run_ranks(poison_bytes: list[int]) -> list[dict]:
    ranks = []
    for rank, byte in enumerate(poison_bytes):
        env = os.environ | {"PYTHONHASHSEED": str(rank)}
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(PROBE), str(byte)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    reports = []
    for process in ranks:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-8000:]
        line = next(x for x in stdout.splitlines() if x.startswith(MARKER))
        reports.append(json.loads(line.removeprefix(MARKER)))
    return reports


def test_two_rank_processes_decide_bit_identically():
    first, second = run_ranks([0x00, 0xFF])
    pairs = zip(first["hashes"], second["hashes"], strict=True)
    differing = [step for step, (a, b) in enumerate(pairs) if a != b]
    write_result(
        "rank_processes.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_rank_processes_gpu.py",
        {
            "setup": "two processes on one GPU at once (PYTHONHASHSEED 0 and 1, free memory "
            "poisoned with 0x00 and 0xFF), 600 seeded steps of 1-256 requests, K=7: budget, "
            "threshold and sps admission in turn, physical depth, compaction, online STS "
            "(refit every 50 steps), acceptance-length depth, batch gate's slowest request",
            "steps": len(first["hashes"]),
            "differing_steps": differing,
            "refits": first["refits"],
            "temperatures": [first["temperatures"], second["temperatures"]],
            "depths_seen": sorted(set(first["depths"])),
            "acceptance_depths_seen": sorted(set(first["acceptance_depths"])),
        },
    )
    assert not differing, f"ranks disagree from step {differing[0]}"
    assert first == second
    # The decisions moved, so agreeing was not trivial.
    assert first["refits"] >= 10 and len(set(first["temperatures"])) > 1
    assert len(set(first["depths"])) > 1 and len(set(first["acceptance_depths"])) > 1
    assert len(set(first["capacity_sums"])) > 50
