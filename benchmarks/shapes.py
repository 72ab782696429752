"""Config-only Qwen3 target, DSpark and DFlash draft checkpoints of a named shape (dummy
weights). A shape named in ``MOE`` has a Qwen3 MoE target (``Qwen3MoeForCausalLM``, vLLM's
fused MoE path); its drafters stay dense Qwen3 layers of the target's width."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # name: hidden, layers, heads, kv heads, head dim, ffn, vocab
    "tiny": (256, 4, 4, 2, 64, 512, 4096),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936),
    # Qwen3-30B-A3B: its ffn is the dense width the drafters get (the target has no dense
    # MLP); MOE gives its experts.
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 6144, 151936),
    # The tiny shape with 8 experts, 2 active: losslessness tests of the MoE path.
    "tiny-moe": (256, 4, 4, 2, 64, 512, 4096),
}
# name: routed experts, experts per token, each expert's intermediate size
MOE = {
    "qwen3-30b-a3b": (128, 8, 768),
    "tiny-moe": (8, 2, 128),
}


def write_shape(shape: str, root: Path, draft_layers: int = 2, block: int = 7) -> dict[str, str]:
    """Write ``target/``, ``draft/`` (DSpark) and ``dflash/`` config folders under ``root``;
    return their paths by those names."""
    hidden, layers, heads, kv_heads, head_dim, ffn, vocab = SHAPES[shape]
    common = dict(
        model_type="qwen3",
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        hidden_act="silu",
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    # Draft taps spread over the target's layers, as DSpark checkpoints do.
    step = max(1, (layers - 3) // 4)
    taps = sorted({min(layers - 3, 1 + i * step) for i in range(5)})
    configs = {
        "target": dict(common, architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers)
        | moe_target(shape),
        "draft": dict(
            common,
            architectures=["Qwen3DSparkModel"],
            num_hidden_layers=draft_layers,
            block_size=block,
            markov_rank=256 if hidden >= 1024 else 16,
            markov_head_type="vanilla",
            enable_confidence_head=False,
            dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": taps},
        ),
    }
    # DFlash: the same parallel drafter without DSpark's Markov and confidence heads.
    configs["dflash"] = {
        key: value
        for key, value in configs["draft"].items()
        if not key.startswith("markov") and key != "enable_confidence_head"
    } | {"architectures": ["DFlashDraftModel"]}
    paths = {}
    for name, config in configs.items():
        folder = root / shape / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        paths[name] = str(folder)
    return paths


def moe_target(shape: str) -> dict:
    """The fields that make a shape's target a Qwen3 MoE (every layer sparse, top-k
    weights renormalised, as Qwen3-30B-A3B); none for a dense shape."""
    if shape not in MOE:
        return {}
    experts, active, expert_ffn = MOE[shape]
    return dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=experts,
        num_experts_per_tok=active,
        moe_intermediate_size=expert_ffn,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )
