"""Which speculator vLLM builds, with and without vllm-dspark options."""

import pytest
import torch

from vllm_dspark.patches.wrapping import ORIGINAL_ATTR


def build_speculator(engine_config, model_dirs, draft, **options):
    from vllm.config import set_current_vllm_config

    config = engine_config(
        {"method": draft, "model": model_dirs[draft], "num_speculative_tokens": 7, **options}
    )
    import vllm.v1.worker.gpu.model_runner as model_runner

    # The runner calls the name it imported; it must be our wrapper.
    assert hasattr(model_runner.init_speculator, ORIGINAL_ATTR)
    with set_current_vllm_config(config):
        return model_runner.init_speculator(config, torch.device("cpu"))


@pytest.mark.parametrize(
    "draft,expected",
    [("dspark", "DSparkPluginSpeculator"), ("dflash", "DFlashPluginSpeculator")],
)
def test_an_option_selects_the_plugin_speculator(engine_config, model_dirs, draft, expected):
    speculator = build_speculator(engine_config, model_dirs, draft, dspark_fp8_draft_head=True)
    assert type(speculator).__name__ == expected
    assert type(speculator).__module__ == "vllm_dspark.speculator"
    assert speculator.options.fp8_draft_head


@pytest.mark.parametrize("draft", ["dspark", "dflash"])
def test_no_option_keeps_the_stock_speculator(engine_config, model_dirs, draft):
    speculator = build_speculator(engine_config, model_dirs, draft)
    assert type(speculator).__module__.startswith("vllm.v1.worker.gpu.spec_decode.")


def test_a_capacity_speculator_brings_the_compaction_patches(
    engine_config, model_dirs, monkeypatch
):
    """Compact verification and DeepSeek-V4's layout go in together, only once a speculator
    with capacity control is built (undone here first: other tests apply them)."""
    import importlib

    from vllm_dspark.patches import dsv4_compact
    from vllm_dspark.patches.wrapping import original

    runner = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    model_state = importlib.import_module(dsv4_compact.MODEL_STATE_MODULE).DefaultModelState
    for owner, name in ((runner, "execute_model"), (model_state, "prepare_attn")):
        monkeypatch.setattr(owner, name, original(owner, name))
    build_speculator(engine_config, model_dirs, "dspark")
    assert not hasattr(runner.execute_model, ORIGINAL_ATTR)
    assert not hasattr(model_state.prepare_attn, ORIGINAL_ATTR)
    build_speculator(engine_config, model_dirs, "dspark", dspark_capacity="threshold")
    assert hasattr(runner.execute_model, ORIGINAL_ATTR)
    assert hasattr(model_state.prepare_attn, ORIGINAL_ATTR)


@pytest.mark.parametrize("draft,applied", [("dspark", True), ("dflash", False)])
def test_a_dspark_speculator_breaks_deepseek_v4_attention_out_of_graphs(
    engine_config, model_dirs, monkeypatch, draft, applied
):
    """The plugin's DSpark speculator, before any graph is captured, has DeepSeek-V4's
    attention decorated again where breakable graphs are on (patches/
    dsv4_breakable_attention.py); DFlash's and stock's leave it as vLLM made it."""
    from vllm_dspark.patches import dsv4_breakable_attention

    calls = []
    monkeypatch.setattr(dsv4_breakable_attention, "apply", lambda: calls.append(True))
    build_speculator(engine_config, model_dirs, draft)
    build_speculator(engine_config, model_dirs, draft, dspark_fp8_draft_head=True)
    assert calls == ([True] if applied else [])
