"""Loading an exported tiny pair's drafter into our PyTorch reference drafter.

The draft folder is a ``Qwen3DSparkModel`` checkpoint that stock vLLM loads
(``config.json``, ``model.safetensors``) plus ``dspark_calibration.json``, the STS
temperatures of the confidence logits. ``lab/tiny_pair/export.py`` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from vllm_dspark.capacity import confidence

from .drafter import DrafterConfig, DSparkDrafter

CONFIDENCE_PREFIX = "confidence_head."
# The draft config.json keys that say the confidence head reads one more input each, the
# top-1 log-probability l of the draft distribution and log(1 - e^l)
# (vllm_dspark.capacity.confidence).
DRAFT_LOGPROB_KEY = confidence.DRAFT_LOGPROB_KEY
DRAFT_MISS_LOGPROB_KEY = confidence.DRAFT_MISS_LOGPROB_KEY


def drafter_config_from_dict(raw: dict) -> DrafterConfig:
    return DrafterConfig(
        vocab_size=raw["vocab_size"],
        target_hidden_size=raw["target_hidden_size"],
        target_layer_ids=list(raw["dflash_config"]["target_layer_ids"]),
        mask_token_id=raw["dflash_config"]["mask_token_id"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_parameters"]["rope_theta"],
        max_position_embeddings=raw["max_position_embeddings"],
        block_size=raw["block_size"],
        markov_rank=raw["markov_rank"],
        loss_decay_gamma=raw.get("loss_decay_gamma", 4.0),
        confidence_draft_logprob=raw.get(DRAFT_LOGPROB_KEY, False),
        confidence_draft_miss_logprob=raw.get(DRAFT_MISS_LOGPROB_KEY, False),
        confidence_head_rows=raw.get("confidence_head_rows", 1),
    )


def load_drafter_from_export(draft_dir: str | Path) -> tuple[DSparkDrafter, list[float] | None]:
    """Our reference drafter from an exported draft folder, and its STS temperatures."""
    draft_dir = Path(draft_dir)
    config = drafter_config_from_dict(json.loads((draft_dir / "config.json").read_text()))
    drafter = DSparkDrafter(config)
    state = {k: v.float() for k, v in load_file(draft_dir / "model.safetensors").items()}
    drafter.load_state_dict(state)
    calibration_path = draft_dir / "dspark_calibration.json"
    temperatures = (
        json.loads(calibration_path.read_text())["temperatures"]
        if calibration_path.exists()
        else None
    )
    return drafter.eval().requires_grad_(False), temperatures
