"""The MoE shapes: config folders vLLM reads as a Qwen3 MoE target with a dense DSpark
drafter of the target's width, and an engine config built for them on CPU."""

import json
import os
from pathlib import Path

import pytest
from shapes import MOE, SHAPES, write_shape


@pytest.mark.parametrize("shape", sorted(MOE))
def test_moe_shape_writes_a_qwen3_moe_target_and_dense_drafters(shape, tmp_path):
    paths = write_shape(shape, tmp_path)
    target = json.loads((Path(paths["target"]) / "config.json").read_text())
    draft = json.loads((Path(paths["draft"]) / "config.json").read_text())
    experts, active, expert_ffn = MOE[shape]
    assert target["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (target["num_experts"], target["num_experts_per_tok"]) == (experts, active)
    assert target["moe_intermediate_size"] == expert_ffn
    assert draft["architectures"] == ["Qwen3DSparkModel"] and draft["model_type"] == "qwen3"
    assert "num_experts" not in draft
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "head_dim"):
        assert draft[key] == target[key]
    assert max(draft["dflash_config"]["target_layer_ids"]) < target["num_hidden_layers"]


def test_qwen3_30b_a3b_is_the_published_shape(tmp_path):
    target = json.loads(
        (Path(write_shape("qwen3-30b-a3b", tmp_path)["target"]) / "config.json").read_text()
    )
    published = dict(
        num_hidden_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=151936,
    )
    assert {key: target[key] for key in published} == published


@pytest.mark.parametrize("shape", sorted(MOE))
def test_vllm_builds_an_engine_config_for_the_moe_target_with_dspark(
    shape, vllm_cpu, tmp_path, monkeypatch
):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dspark

    vllm_dspark.register()
    for name in [n for n in os.environ if n.startswith("VLLM_DSPARK_")]:
        monkeypatch.delenv(name)
    paths = write_shape(shape, tmp_path)
    config = EngineArgs(
        model=paths["target"],
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        speculative_config={
            "method": "dspark",
            "model": paths["draft"],
            "num_speculative_tokens": 7,
            "dspark_capacity": "sps",
            "dspark_sps_curve": [[1, 100.0], [16, 99.0], [128, 20.0]],
            "dspark_varlen_verify": True,
            # As offline_sweep's --acceptance confidence: the dummy drafter has no head.
            "dspark_synthetic_confidence": [0.8, 0.78, 0.77, 0.77, 0.76, 0.75, 0.76],
        },
    ).create_engine_config()
    hf = config.model_config.hf_config
    assert hf.model_type == "qwen3_moe" and hf.num_experts == MOE[shape][0]
    assert config.model_config.architectures == ["Qwen3MoeForCausalLM"]
    assert config.speculative_config.method == "dspark"
    assert config.speculative_config.draft_model_config.hf_config.hidden_size == SHAPES[shape][0]
