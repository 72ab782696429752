"""With the plugin installed and no option set, vLLM runs exactly as stock."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

PROBE = Path(__file__).with_name("stock_probe.py")


def probe(model_dirs, plugins: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSPARK_")}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    done = subprocess.run(
        [sys.executable, str(PROBE), model_dirs["target"], model_dirs["dspark"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plugin_is_an_installed_general_plugin():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("vllm_dspark") == "vllm_dspark:register"


def test_no_option_means_stock(model_dirs):
    others = [
        ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != "vllm_dspark"
    ]
    stock = probe(model_dirs, plugins=",".join(others) or "none")
    with_plugin = probe(model_dirs, plugins=None)
    # The probe really ran with and without the plugin...
    assert not stock["patched"] and with_plugin["patched"]
    # ...and vLLM built and would run the same thing.
    assert with_plugin["hash"] == stock["hash"]
    assert with_plugin["additional_config"] == stock["additional_config"] == {}
    assert stock["runner"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    assert with_plugin["runner"] == stock["runner"]
    expected = "vllm.v1.worker.gpu.spec_decode.dspark.speculator.DSparkSpeculator"
    assert stock["speculator"] == with_plugin["speculator"] == expected
