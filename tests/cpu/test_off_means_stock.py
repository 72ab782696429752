"""With the plugin installed and no option set, vLLM runs exactly as stock."""

from importlib.metadata import entry_points
from pathlib import Path

from subprocess_probe import run_probe, without_dspark_plugin

PROBE = Path(__file__).with_name("stock_probe.py")


def probe(model_dirs, plugins: str | None) -> dict:
    return run_probe(
        PROBE, model_dirs["target"], model_dirs["dspark"], plugins=plugins, timeout=300
    )


def test_plugin_is_an_installed_general_plugin():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("vllm_dspark") == "vllm_dspark:register"


def test_no_option_means_stock(model_dirs):
    stock = probe(model_dirs, plugins=without_dspark_plugin())
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
