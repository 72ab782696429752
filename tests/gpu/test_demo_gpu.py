"""On a GPU: `vllm-dspark demo` with small settings (three engines of the embedded pair) runs
to its end, in float32 every arm's greedy outputs equal no speculation's, and its record
holds what the README's demo section reads. A fresh process, as a user runs it (vLLM's
engines fork from it)."""

import json
import subprocess
import sys

import pytest

from vllm_dspark.demo import EMBEDDED_PAIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def test_demo_on_the_gpu(tmp_path):
    record_path, plot_path = tmp_path / "demo.json", tmp_path / "demo.png"
    command = [sys.executable, "-m", "vllm_dspark.cli", "demo", "--device", "gpu"]
    command += ["--prompts", "16", "--max-tokens", "32", "--concurrency", "1,16"]
    command += ["--dtype", "float32"]
    command += ["--repeats", "1", "--json", str(record_path), "--plot", str(plot_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[3/3] starting engine: adaptive (sps)" in done.stdout
    record = json.loads(record_path.read_text())
    arms = {(arm["arm"], arm["concurrency"]): arm for arm in record["arms"]}
    assert set(arms) == {(a, c) for a in ("nospec", "fixed", "adaptive") for c in (1, 16)}
    for (arm, _), row in arms.items():
        assert row["tok_s"] > 0
        if arm != "nospec":
            assert row["greedy_identical"], row
            assert row["acceptance_length"] > 1.5
    assert arms[("fixed", 16)]["drafts_per_request"] == pytest.approx(7.0)
    assert record["confidence_calibration"]["adaptive"]["mean_predicted"]
    assert record["wall_s"] > 0 and record["device"]
    assert plot_path.read_bytes()[:4] == b"\x89PNG"
