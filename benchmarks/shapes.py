"""Config-only Qwen3 target, DSpark and DFlash draft checkpoints of a named shape (dummy
weights). A shape named in ``MOE`` has a Qwen3 MoE target (``Qwen3MoeForCausalLM``, vLLM's
fused MoE path); its drafters stay dense Qwen3 layers of the target's width."""

from __future__ import annotations

import json
import tempfile
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


def shape_root(driver: str) -> Path:
    """The folder a benchmark driver writes its shapes under: the same path on every run
    and machine, because vLLM keys its torch.compile cache by the model's (and drafter's)
    path, so shapes in a new temporary folder miss the cache on every start. ``driver``
    keeps drivers that write different files beside a shape apart."""
    return Path(tempfile.gettempdir()) / "vllm-dspark-shapes" / driver


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


# DeepSeek-V4-Flash with its DSpark module, as the -0731 checkpoint's config.json gives it
# (docs/design/deepseek-v4.md names the source of each value). The drafter has no folder
# of its own: vLLM builds DSparkDraftModel from this same config (method "dspark" with no
# "model") with three MoE layers (its default when no n_mtp_layers is given), fed by the
# target layers dspark_target_layer_ids, and loads them from the target's mtp.0-2 tensors.
DSV4_FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    # Per layer: 0 sliding window only, 4 compressed sparse (with an indexer), 128 heavily
    # compressed; the entries past the target's layers are the DSpark module's.
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    compress_rope_theta=160000,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    num_hash_layers=3,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    hidden_act="silu",
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=16,
        original_max_position_embeddings=65536,
        beta_fast=32,
        beta_slow=1,
    ),
    max_position_embeddings=1048576,
    num_nextn_predict_layers=1,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=[40, 41, 42],
    dspark_markov_rank=256,
    expert_dtype="fp4",
    quantization_config=dict(
        quant_method="fp8",
        activation_scheme="dynamic",
        fmt="e4m3",
        scale_fmt="ue8m0",
        weight_block_size=[128, 128],
    ),
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
# name: the fields that differ from DSV4_FLASH
DSV4 = {
    # Every layer (43 and the DSpark module's 3), 64 of the 256 routed experts, top-6 kept.
    "dsv4-flash-reduced": dict(n_routed_experts=64),
    # Losslessness tests: a layer of each attention and routing kind (sliding window and
    # ratio 4 hash-routed, ratio 128 and 4 score-routed), 16 experts, a narrow residual
    # stream and a small vocabulary. The attention geometry stays Flash's: vLLM's sparse
    # MLA, indexer and output-projection kernels are built for it.
    "tiny-dsv4": dict(
        hidden_size=1024,
        num_hidden_layers=5,
        compress_ratios=[0, 0, 4, 128, 4, 0, 0, 0],
        dspark_target_layer_ids=[2, 3, 4],
        n_routed_experts=16,
        moe_intermediate_size=512,
        vocab_size=4096,
        dspark_noise_token_id=4095,
    ),
}
DSPARK_LAYERS = 3  # vLLM's DSpark module for DeepSeek-V4 without n_mtp_layers in the config


def deepseek_v4_config(shape: str) -> dict:
    """config.json of a DeepSeek-V4 shape named in ``DSV4``."""
    return DSV4_FLASH | DSV4[shape]


def write_deepseek_v4_shape(shape: str, root: Path) -> str:
    """Write ``root/<shape>/config.json`` and return that folder: the target, and with
    ``--speculative-config '{"method": "dspark", ...}'`` its DSpark module too."""
    folder = root / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(deepseek_v4_config(shape), indent=1))
    return str(folder)


def deepseek_v4_weight_bytes(config: dict) -> dict[str, int]:
    """Bytes of the weights vLLM 0.26.0 allocates for a DeepSeek-V4 config on one GPU
    (before a MoE backend repacks its experts): ``embedding`` (the embedding and LM head,
    which the drafter shares), ``target_layers`` (the rest of the target) and ``dspark``
    (the drafter's own layers and heads). Linears are FP8 with a one-byte (e8m0) scale
    per 128x128 block, as with FP4 experts; routed experts MXFP4 (half a byte a weight, a
    byte per 32); the compressors, routers and embeddings bfloat16; the mHC mixers
    float32."""
    hidden, hc = config["hidden_size"], config["hc_mult"]
    q_rank, head, heads = config["q_lora_rank"], config["head_dim"], config["num_attention_heads"]
    groups, o_rank = config["o_groups"], config["o_lora_rank"]
    experts, expert_ffn = config["n_routed_experts"], config["moe_intermediate_size"]
    vocab = config["vocab_size"]
    padded_vocab = -(-vocab // 64) * 64  # vLLM pads embedding rows to a multiple of 64
    block = config["quantization_config"]["weight_block_size"]

    def fp8_linear(out_features: int, in_features: int) -> int:
        scales = -(-out_features // block[0]) * -(-in_features // block[1])
        return out_features * in_features + scales

    def compressor(ratio: int, width: int) -> int:
        overlap = 2 if ratio == 4 else 1  # ratio 4 compresses overlapping windows
        # kv and gate projections (bf16), positional bias (fp32), norm (bf16)
        return 2 * 2 * overlap * width * hidden + 4 * ratio * overlap * width + 2 * width

    def mhc_head() -> int:
        return 4 * (hc * hc * hidden + hc + 1)

    def layer(ratio: int, hash_routed: bool) -> int:
        mixes = (2 + hc) * hc
        size = 2 * 4 * (mixes * hc * hidden + mixes + 3)  # mHC before attention and FFN
        size += 2 * 2 * hidden  # attention and FFN norms
        size += fp8_linear(q_rank + head, hidden) + fp8_linear(heads * head, q_rank)
        size += fp8_linear(groups * o_rank, heads * head // groups)
        size += fp8_linear(hidden, groups * o_rank)
        size += 2 * q_rank + 2 * head + 4 * (64 if heads <= 64 else 128)  # norms, sink
        if ratio > 1:
            size += compressor(ratio, head)
        if ratio == 4:
            index_heads, index_head = config["index_n_heads"], config["index_head_dim"]
            size += fp8_linear(index_heads * index_head, q_rank) + 2 * index_heads * hidden
            size += compressor(4, index_head)
        size += 2 * experts * hidden  # router
        if hash_routed:
            size += 4 * vocab * config["num_experts_per_tok"]  # token-to-expert table
        elif config.get("topk_method") == "noaux_tc":
            size += 4 * experts  # selection bias
        shared = expert_ffn * config["n_shared_experts"]
        size += fp8_linear(2 * shared, hidden) + fp8_linear(hidden, shared)
        size += experts * 3 * expert_ffn * hidden * 17 // 32  # MXFP4 weights and scales
        return size

    layers = config["num_hidden_layers"]
    ratios = config["compress_ratios"]
    target = sum(layer(ratios[i], i < config["num_hash_layers"]) for i in range(layers))
    dspark = DSPARK_LAYERS * layer(1, False)
    dspark += fp8_linear(hidden, hidden * len(config["dspark_target_layer_ids"]))
    dspark += 2 * 2 * hidden + mhc_head()  # its input and final norms, mHC head
    dspark += 2 * 2 * padded_vocab * config["dspark_markov_rank"]  # Markov head
    return {
        "embedding": 2 * 2 * padded_vocab * hidden,
        "target_layers": target + 2 * hidden + mhc_head(),
        "dspark": dspark,
    }
