"""dspark_fp8_draft_backbone: the drafter's layers in vLLM's online FP8 (CPU).

The option asks vLLM to quantise the draft; what the plugin adds is the context-K/V
projection, which vLLM 0.26.0's DFlash-family drafters slice out of each layer's
``qkv_proj.weight`` as a bf16 [out, in] matrix that online quantisation has replaced."""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

from vllm_dspark.config import DSparkOptionError, DSparkOptions, check_against_speculative_config
from vllm_dspark.context_kv import rebuild_fp8_context_kv

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 4, 2, 8, 2
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def test_the_option_quantises_the_draft_and_not_the_target(engine_config, model_dirs):
    base = {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": 7}
    config = engine_config(base | {"dspark_fp8_draft_backbone": True})
    draft = config.speculative_config.draft_model_config
    assert draft.quantization == "fp8_per_tensor"
    assert config.model_config.quantization is None
    # vLLM builds the draft's quantisation from the online arguments, not from files that
    # a bf16 checkpoint does not have (the failure this avoids: H100, 2b4a3dc).
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    assert isinstance(get_quant_config(draft, config.load_config), OnlineQuantizationConfig)
    assert engine_config(base).speculative_config.draft_model_config.quantization is None
    with pytest.raises(DSparkOptionError, match="asks quantization='awq'"):
        engine_config(base | {"dspark_fp8_draft_backbone": True, "quantization": "awq"})
    with pytest.raises(DSparkOptionError, match="this engine runs torch.float32"):
        engine_config(base | {"dspark_fp8_draft_backbone": True}, dtype="float32")


def test_an_already_quantised_draft_is_refused():
    draft = SimpleNamespace(hf_config=SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    speculative_config = SimpleNamespace(
        method="dspark", model="deepseek-v4", draft_model_config=draft
    )
    with pytest.raises(DSparkOptionError, match=r"already quantised \(fp8\)"):
        check_against_speculative_config(DSparkOptions(fp8_draft_backbone=True), speculative_config)


class Qkv(torch.nn.Module):
    """A QKVParallelLinear after vLLM's online per-tensor FP8: e4m3 [in, out], one scale."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.input_size_per_partition, self.output_size_per_partition = HIDDEN, Q + 2 * KV
        self.weight_scale = weight.abs().amax().float() / 448
        quantised = (weight.float() / self.weight_scale).t().to(torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(quantised, requires_grad=False)
        self.bias = None


class Drafter(torch.nn.Module):
    """The attributes vLLM's DFlashQwen3Model._build_fused_kv_buffers reads, with its own
    code run on them."""

    _build_fused_kv_buffers = DFlashQwen3Model._build_fused_kv_buffers
    _build_context_kv_buffers = DFlashQwen3Model._build_context_kv_buffers

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.hidden_norm = torch.nn.RMSNorm(HIDDEN).to(torch.bfloat16)
        layers = []
        for weight in weights:
            attention = torch.nn.Module()
            attention.qkv_proj = Qkv(weight)
            attention.k_norm = torch.nn.RMSNorm(HEAD_DIM)
            attention.q_norm = SimpleNamespace(variance_epsilon=1e-6)
            attention.rotary_emb = SimpleNamespace(
                head_size=HEAD_DIM, cos_sin_cache=torch.zeros(4, HEAD_DIM), is_neox_style=True
            )
            attention.q_size, attention.kv_size = Q, KV
            attention.head_dim, attention.num_kv_heads = HEAD_DIM, KV_HEADS
            attention.attn = object()
            layer = torch.nn.Module()
            layer.self_attn = attention
            layers.append(layer)
        self.layers = torch.nn.ModuleList(layers)


def test_the_context_kv_projection_is_rebuilt_from_the_dequantised_weights():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(Q + 2 * KV, HIDDEN, generator=gen).bfloat16() for _ in range(LAYERS)]
    drafter = Drafter(weights)
    stored = [layer.self_attn.qkv_proj.weight for layer in drafter.layers]
    rebuild_fp8_context_kv(SimpleNamespace(model=drafter))
    dequantised = [
        (qkv.weight.float() * qkv.weight_scale).t()
        for qkv in (layer.self_attn.qkv_proj for layer in drafter.layers)
    ]
    expected = torch.cat([w[Q:] for w in dequantised]).bfloat16()
    assert drafter._fused_kv_weight.dtype == torch.bfloat16
    assert torch.equal(drafter._fused_kv_weight, expected)
    # Within e4m3's rounding of the bf16 rows they stand for.
    torch.testing.assert_close(
        drafter._fused_kv_weight.float(),
        torch.cat([w[Q:] for w in weights]).float(),
        rtol=0.07,
        atol=0.07 * max(w.abs().max().item() for w in weights) / 8,
    )
    # The layers keep their FP8 weights for their own forward.
    assert [layer.self_attn.qkv_proj.weight for layer in drafter.layers] == stored


def test_a_bf16_drafter_is_left_alone_and_an_unknown_fp8_layout_refused():
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(Q + 2 * KV, HIDDEN, generator=gen).bfloat16() for _ in range(LAYERS)]
    drafter = Drafter(weights)
    for layer in drafter.layers:
        layer.self_attn.qkv_proj.weight = torch.nn.Parameter(weights[0], requires_grad=False)
    rebuild_fp8_context_kv(SimpleNamespace(model=drafter))
    assert not hasattr(drafter, "_fused_kv_weight")  # stock builds it, from bf16
    drafter = Drafter(weights)
    qkv = drafter.layers[0].self_attn.qkv_proj
    qkv.weight = torch.nn.Parameter(qkv.weight.data.t().contiguous(), requires_grad=False)
    with pytest.raises(RuntimeError, match="expected vLLM 0.26.0's online per-tensor layout"):
        rebuild_fp8_context_kv(SimpleNamespace(model=drafter))
