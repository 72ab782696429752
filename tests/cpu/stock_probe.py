"""Run in a subprocess: build a DSpark engine config and print what vLLM would run.

Prints JSON: the config hash, the model runner and speculator classes, and whether
vllm-dspark's patches were applied in this process.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from vllm_cpu import select_cpu_platform  # noqa: E402

if select_cpu_platform():
    import vllm.config.vllm

    vllm.config.vllm.HAS_TRITON = True  # DSpark forces the V2 runner; see tests/conftest.py

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_dspark.patches.wrapping import ORIGINAL_ATTR  # noqa: E402


def main(target: str, draft: str) -> None:
    args = EngineArgs(
        model=target,
        load_format="dummy",
        skip_tokenizer_init=True,
        speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": 7},
    )
    config = args.create_engine_config()
    # What vllm/v1/worker/gpu_worker.py instantiates for this config.
    if config.use_v2_model_runner:
        from vllm.v1.worker.gpu import model_runner
    else:
        from vllm.v1.worker import gpu_model_runner as model_runner
    runner_cls = model_runner.GPUModelRunner
    with set_current_vllm_config(config):
        speculator = model_runner.init_speculator(config, torch.device("cpu"))
    print(
        "PROBE "
        + json.dumps(
            {
                "hash": config.compute_hash(),
                "additional_config": config.additional_config,
                "runner": f"{runner_cls.__module__}.{runner_cls.__qualname__}",
                "speculator": f"{type(speculator).__module__}.{type(speculator).__qualname__}",
                "patched": hasattr(EngineArgs.create_speculative_config, ORIGINAL_ATTR),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
