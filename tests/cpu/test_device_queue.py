"""tools/device/queue.sh: stages run in a background session, in order, and their results
come back in one archive with the log (on the device machine, a call's own processes end
with it; here the copied tree holds a stand-in gpu_stage.sh)."""

import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).parents[2] / "tools" / "device"
FAKE_STAGE = """#!/usr/bin/env bash
# stand-in: STAGE COMMIT [ARG...]; writes its arguments and compile cache, fails for "bad";
# "meet" waits (10 s at most) until another "meet" has started
echo "$@ ${VLLM_CACHE_ROOT:-shared}" > "$OUT/args.txt"; touch "$OUT/../started-$1-$$"
if [ "$1" = meet ]; then
  for _ in $(seq 100); do
    [ "$(ls "$OUT"/../started-meet-* | wc -l)" -ge 2 ] && exit 0; sleep 0.1
  done
  exit 1
fi
if [ "$1" = long ]; then  # a stage with a child process that outlives a call
  sleep 300 & echo $! > "$OUT/../long.pid"; wait
fi
[ "$1" != bad ]
"""
FAKE_BUNDLE = 'echo installed >> "$QUEUE_ROOT/installs"\n'


@pytest.fixture
def queue(tmp_path):
    """``queue(*args)``: queue.sh's output, run from a copied tree whose gpu_stage.sh and
    bundle.sh are stand-ins; $OUT is tmp_path/out, the queue's root tmp_path/queue."""
    tree = tmp_path / "tree"
    (tree / "tools" / "device").mkdir(parents=True)
    shutil.copy(TOOLS / "queue.sh", tree / "tools" / "device")
    (tree / "tools" / "device" / "gpu_stage.sh").write_text(FAKE_STAGE)
    (tree / "tools" / "device" / "bundle.sh").write_text(FAKE_BUNDLE)
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "QUEUE_ROOT": str(tmp_path / "queue")}

    def run(*args):
        return subprocess.run(
            ["bash", "tools/device/queue.sh", *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    return run


def test_queue_runs_stages_in_order_and_packs_their_results(tmp_path, queue):
    out = tmp_path / "out"
    # On a machine where no queue ran (a fresh one, the earlier having gone back): said.
    assert "no queue on this machine" in queue("wait", "30")
    assert "queued" in queue("start", "abc123", "fixed-k:3:1024:nospec,dspark", "bad")
    assert "queue done" in queue("wait", "30")
    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
        args = archive.extractfile("results/fixed-k-1/args.txt").read().decode()
        log = archive.extractfile("results/queue.log").read().decode()
    assert "results/bad-2/args.txt" in names
    assert args.split() == ["fixed-k", "abc123", "3", "1024", "nospec,dspark", "shared"]
    assert "fixed-k:3:1024:nospec,dspark rc=0" in log and "bad rc=1" in log
    # A second queue adds its results beside the first's.
    queue("start", "abc123", "again")
    queue("wait", "30")
    with tarfile.open(out / "results.tar.gz") as archive:
        assert any(name.startswith("results/again-") for name in archive.getnames())
    # A failing gate (a trailing !) stops the queue; a passing one does not.
    queue("start", "abc123", "gate!", "bad!", "never")
    queue("wait", "30")
    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
        log = archive.extractfile("results/queue.log").read().decode()
    assert "gate! rc=0" in log and "queue stopped: bad! failed" in log
    assert not any(name.startswith("results/never-") for name in names)
    # Stages joined by + run side by side, after one bundle install, with their own caches.
    queue("start", "abc123", "meet+meet!", "after")
    queue("wait", "30")
    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
        log = archive.extractfile("results/queue.log").read().decode()
        caches = {
            archive.extractfile(name).read().decode().split()[-1]
            for name in names
            if name.startswith("results/meet-") and name.endswith("args.txt")
        }
    assert "meet+meet! rc=0" in log and "after rc=0" in log
    assert len(caches) == 2 and "shared" not in caches
    assert (tmp_path / "queue" / "installs").read_text().count("installed") == 1


def test_stop_ends_the_queue_and_its_stages_processes(tmp_path, queue):
    assert "no queue has run here" in queue("stop")
    queue("start", "abc123", "long", "next")
    pid_file = tmp_path / "queue" / "results" / "long.pid"
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.1)
    sleeper = int(pid_file.read_text())
    assert "queue stopped by queue.sh stop" in queue("stop")
    assert not (tmp_path / "queue" / "running").exists()
    time.sleep(0.5)
    assert not Path(f"/proc/{sleeper}").exists()  # the stage's child went with the group
    assert not any(p.name.startswith("next-") for p in (tmp_path / "queue" / "results").iterdir())
