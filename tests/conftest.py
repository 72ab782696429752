import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from vllm_cpu import select_cpu_platform, write_model_dirs  # noqa: E402


def pytest_configure(config):
    # Before collection imports vLLM's config modules (see vllm_cpu.py).
    select_cpu_platform()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return write_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture
def vllm_cpu(monkeypatch):
    """Let vLLM build V2-model-runner configs without a GPU.

    DSpark forces the V2 runner, whose config check wants Triton with an active
    driver; on the CPU platform we only build configs, never run kernels.
    """
    import vllm.config.vllm as vllm_config_module

    if not torch.cuda.is_available():
        monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


@pytest.fixture
def engine_config(vllm_cpu, model_dirs, monkeypatch):
    """Build a VllmConfig for the tiny target with the plugin registered."""
    import vllm_dspark

    vllm_dspark.register()
    for name in [n for n in os.environ if n.startswith("VLLM_DSPARK_")]:
        monkeypatch.delenv(name)

    def build(speculative_config=None, **kwargs):
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(
            model=model_dirs["target"],
            load_format="dummy",
            skip_tokenizer_init=True,
            speculative_config=speculative_config,
            **kwargs,
        )
        return args.create_engine_config()

    return build


@pytest.fixture
def plugin_speculator(engine_config, model_dirs):
    """Build vllm-dspark's DSpark (or, ``method="dflash"``, DFlash) speculator on CPU:
    ``num_drafts`` drafts, compact verification, and the given further ``dspark_``
    options, for up to ``max_num_seqs`` requests (vLLM's default without it)."""

    def build(num_drafts=7, method="dspark", max_num_seqs=None, **options):
        from vllm.config import set_current_vllm_config

        from vllm_dspark.config import DSparkOptions
        from vllm_dspark.speculator import DFlashPluginSpeculator, DSparkPluginSpeculator

        config = engine_config(
            {
                "method": method,
                "model": model_dirs[method],
                "num_speculative_tokens": num_drafts,
                "dspark_varlen_verify": True,
                **options,
            },
            **({} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}),
        )
        speculator = DSparkPluginSpeculator if method == "dspark" else DFlashPluginSpeculator
        with set_current_vllm_config(config):
            return speculator(config, torch.device("cpu"), DSparkOptions.from_vllm_config(config))

    return build


@pytest.fixture
def sps_speculator(plugin_speculator):
    """:func:`plugin_speculator` in ``sps`` mode with a given SPS curve that falls past 16
    tokens per step and no step overhead: the draft gate weighs from the first step."""

    def build(num_drafts=7, **options):
        return plugin_speculator(
            num_drafts,
            dspark_capacity="sps",
            dspark_sps_curve=[[1, 100.0], [16, 99.0], [128, 20.0]],
            dspark_step_overhead_ms=0.0,
            **options,
        )

    return build
