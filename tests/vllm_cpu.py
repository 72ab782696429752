"""Build real vLLM configs on a machine without a GPU.

vLLM's CUDA wheel detects no platform there, so configs fail ("Device string must
not be empty"). Selecting vLLM's own CPU platform before anything resolves
``vllm.platforms.current_platform`` fixes that; it must run before the first
import of vLLM's config modules, which bind the platform at import time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A tiny Qwen3 shape: configs only, weights are dummy.
_QWEN3 = dict(
    model_type="qwen3",
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    hidden_act="silu",
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def select_cpu_platform() -> bool:
    """Use vLLM's CPU platform when there is no CUDA GPU; return whether it did."""
    if torch.cuda.is_available():
        return False
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    return True


def write_model_dirs(root: Path) -> dict[str, str]:
    """Config-only checkpoints: a target, DSpark drafts with/without confidence head,
    and a DFlash draft. Returns their paths by name."""
    drafter = dict(
        _QWEN3,
        num_hidden_layers=1,
        block_size=7,
        dflash_config={"mask_token_id": 4095, "target_layer_ids": [0, 2]},
    )
    configs = {
        "target": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], num_hidden_layers=4),
        "dspark": dict(
            drafter,
            architectures=["Qwen3DSparkModel"],
            markov_rank=16,
            markov_head_type="vanilla",
            enable_confidence_head=True,
        ),
        "dspark_no_confidence": dict(
            drafter,
            architectures=["Qwen3DSparkModel"],
            markov_rank=16,
            markov_head_type="vanilla",
            enable_confidence_head=False,
        ),
        "dflash": dict(drafter, architectures=["DFlashDraftModel"]),
    }
    paths = {}
    for name, config in configs.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        paths[name] = str(folder)
    return paths
