"""Config-only Qwen3 target, DSpark and DFlash draft checkpoints of a named shape (dummy
weights)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # name: hidden, layers, heads, kv heads, head dim, ffn, vocab
    "tiny": (256, 4, 4, 2, 64, 512, 4096),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936),
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
        "target": dict(common, architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers),
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
