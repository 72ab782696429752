"""On a GPU: with the plugin loaded and no option set, DSpark output is stock's.

Set DSPARK_RESULTS_DIR to also write ``foundation_gpu.json`` there.
"""

import datetime
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).with_name("llm_probe.py")
NUM_PROMPTS, MAX_TOKENS = 8, 64


def run_probe(model_dirs, plugins: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSPARK_")}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    command = [
        sys.executable,
        str(PROBE),
        model_dirs["target"],
        model_dirs["dspark"],
        str(NUM_PROMPTS),
        str(MAX_TOKENS),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_dspark_output_is_stock_with_plugin_loaded(model_dirs):
    others = [
        ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != "vllm_dspark"
    ]
    stock = run_probe(model_dirs, plugins=",".join(others) or "none")
    with_plugin = run_probe(model_dirs, plugins=None)
    identical = stock["token_ids"] == with_plugin["token_ids"]
    results_dir = os.environ.get("DSPARK_RESULTS_DIR")
    if results_dir:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or "unknown"
        )
        record = {
            "command": "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_foundation_gpu.py",
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0),
            "setup": {
                "target": "tiny Qwen3 (4 layers, hidden 256, vocab 4096), dummy weights",
                "draft": "Qwen3DSparkModel, 1 layer, k=7",
                "prompts": NUM_PROMPTS,
                "max_tokens": MAX_TOKENS,
                "sampling": "greedy",
            },
            "result": {
                "greedy_token_ids_identical": identical,
                "plugin_loaded": {
                    "stock_arm": stock["patched"],
                    "plugin_arm": with_plugin["patched"],
                },
                "spec_decode_stock": stock["spec_decode"],
                "spec_decode_plugin": with_plugin["spec_decode"],
                "engine_load_s": {"stock": stock["load_s"], "plugin": with_plugin["load_s"]},
            },
        }
        Path(results_dir, "foundation_gpu.json").write_text(json.dumps(record, indent=2))
    assert not stock["patched"] and with_plugin["patched"]
    assert all(len(ids) == MAX_TOKENS for ids in stock["token_ids"])
    assert identical
