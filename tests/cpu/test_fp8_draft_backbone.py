"""dspark_fp8_draft_backbone: the drafter's layers in rowwise FP8 (CPU).

The option leaves vLLM's configs alone; once the draft has loaded, the plugin converts the
linear layers of its decoder layers (vllm_dspark.draft_fp8). On the CPU the FP8 product
runs through the dequantised operands; tests/gpu/test_draft_fp8_gpu.py and
tests/gpu/test_pair_arms_gpu.py run the GPU path."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)

from vllm_dspark.config import DSparkOptionError, DSparkOptions, check_against_speculative_config
from vllm_dspark.draft_fp8 import Fp8DraftLinearMethod, fp8_linear, quantize_draft_backbone
from vllm_dspark.head.fp8_rowwise import E4M3_REL_ERR, quantize_rows


def test_the_option_leaves_the_configs_stock(engine_config, model_dirs):
    base = {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": 7}
    config = engine_config(base | {"dspark_fp8_draft_backbone": True})
    assert config.speculative_config.draft_model_config.quantization is None
    assert config.model_config.quantization is None
    assert config.additional_config["dspark"] == {"fp8_draft_backbone": True}
    with pytest.raises(DSparkOptionError, match=r"already quantised \(fp8\)"):
        engine_config(base | {"dspark_fp8_draft_backbone": True, "quantization": "fp8"})
    with pytest.raises(DSparkOptionError, match="this engine runs torch.float32"):
        engine_config(base | {"dspark_fp8_draft_backbone": True}, dtype="float32")


def test_an_already_quantised_draft_is_refused():
    draft = SimpleNamespace(hf_config=SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    speculative_config = SimpleNamespace(
        method="dspark", model="deepseek-v4", draft_model_config=draft
    )
    with pytest.raises(DSparkOptionError, match=r"already quantised \(fp8\)"):
        check_against_speculative_config(DSparkOptions(fp8_draft_backbone=True), speculative_config)


def test_the_fp8_product_stays_within_e4m3_rounding_of_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen).bfloat16()
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    q, scale = quantize_rows(weight)
    out = fp8_linear(x, q, scale, bias)
    assert out.shape == (3, 5, 48) and out.dtype == torch.bfloat16
    exact = x.float() @ weight.float().t() + bias.float()
    # Each operand within e4m3's relative rounding: |error| <= (2u + u^2) sum |x||w| (+ bf16).
    bound = (2 * E4M3_REL_ERR + E4M3_REL_ERR**2) * (x.float().abs() @ weight.float().abs().t())
    assert bool(((out.float() - exact).abs() <= bound + 0.02 * exact.abs() + 1e-2).all())
    # ... and not the bf16 product itself: the weights really are in FP8.
    assert not torch.equal(out, (x @ weight.t() + bias))


@pytest.fixture
def drafter(engine_config, model_dirs, monkeypatch):
    """A drafter-shaped module of vLLM's own linear layers, bf16, as loaded: decoder layers
    with a QKV and an output projection, a layer outside them, and one whose width cuBLASLt's
    FP8 GEMM cannot take."""
    import vllm.model_executor.parameter as parameter

    # One rank, without a process group (vLLM's parameters record their TP rank).
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    config = engine_config(
        {"method": "dspark", "model": model_dirs["dspark"], "num_speculative_tokens": 7}
    )
    gen = torch.Generator().manual_seed(1)
    with set_current_vllm_config(config):
        layer = torch.nn.Module()
        layer.qkv_proj = QKVParallelLinear(
            64, 16, 4, 2, bias=False, params_dtype=torch.bfloat16, disable_tp=True
        )
        layer.o_proj = RowParallelLinear(
            64, 64, bias=False, params_dtype=torch.bfloat16, disable_tp=True
        )
        layer.odd = ReplicatedLinear(
            64, 40, bias=False, params_dtype=torch.bfloat16, disable_tp=True
        )
        inner = torch.nn.Module()
        inner.layers = torch.nn.ModuleList([layer])
        inner.fc = ReplicatedLinear(
            64, 64, bias=False, params_dtype=torch.bfloat16, disable_tp=True
        )
        built = []
        inner._build_fused_kv_buffers = lambda: built.append(layer.qkv_proj.weight.dtype)
    for module in (layer.qkv_proj, layer.o_proj, layer.odd, inner.fc):
        module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen))
        module.quant_method.process_weights_after_loading(module)  # as loading ends
    return SimpleNamespace(model=inner), layer, built


def test_the_decoder_layers_go_to_fp8_after_the_context_kv_projection(drafter):
    model, layer, built = drafter
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = {name: getattr(layer, name)(x)[0] for name in ("qkv_proj", "o_proj", "odd")}
    assert quantize_draft_backbone(model) == 2
    # Built once, before any weight changed (it reads the bf16 qkv_proj rows).
    assert built == [torch.bfloat16]
    for name in ("qkv_proj", "o_proj"):
        module = getattr(layer, name)
        assert module.weight.dtype == torch.float8_e4m3fn
        assert isinstance(module.quant_method, Fp8DraftLinearMethod)
        after = module(x)[0]
        assert after.dtype == torch.bfloat16 and not torch.equal(after, before[name])
        # e4m3 keeps about 2 significant digits: a few percent of the output's norm.
        error = (after.float() - before[name].float()).norm() / before[name].float().norm()
        assert 0 < error < 0.06
    # Outside the decoder layers, or too narrow for the FP8 GEMM: left in bf16.
    assert isinstance(model.model.fc.quant_method, UnquantizedLinearMethod)
    assert layer.odd.weight.dtype == torch.bfloat16
    assert torch.equal(layer.odd(x)[0], before["odd"])


def test_a_non_finite_weight_is_refused(drafter):
    model, layer, _ = drafter
    layer.o_proj.weight.data[3, 5] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite weight in RowParallelLinear"):
        quantize_draft_backbone(model)


def test_the_fp8_product_traces_into_one_graph():
    """vLLM compiles the drafter's forward: the FP8 layers must trace without a break."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    q, scale = quantize_rows(torch.randn(32, 64, generator=gen))
    compiled = torch.compile(fp8_linear, backend="eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, q, scale, None), fp8_linear(x, q, scale, None))
