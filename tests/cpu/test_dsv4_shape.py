"""The DeepSeek-V4 shapes (benchmarks/shapes.py): config folders vLLM 0.26.0 reads as a
DeepSeek-V4 target whose DSpark module comes from the same config, and whose weights vLLM
allocates as ``deepseek_v4_weight_bytes`` counts them.

vLLM's model classes are built on the meta device in a fresh process (run as a script,
this file is that probe): the model needs a process group, and its constructors reach for
CUDA streams, the GPU's compute capability and kernel choices. The probe stands in for
those four (as on an H100: compute capability 9.0, Marlin for the MXFP4 experts), so the
modules and their parameters are vLLM's own, only allocated nowhere."""

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[2] / "benchmarks")]

from shapes import (  # noqa: E402
    DSPARK_LAYERS,
    DSV4,
    DSV4_FLASH,
    deepseek_v4_config,
    deepseek_v4_weight_bytes,
    write_deepseek_v4_shape,
)

NUM_DRAFTS = 5  # the DSpark module's block: vLLM refuses fewer drafts
# The -0731 checkpoint's safetensors (target and DSpark module), from its index's
# total_size (docs/design/deepseek-v4.md).
FLASH_0731_CHECKPOINT_BYTES = 166_878_536_440


def test_flash_values_are_the_published_config():
    published = dict(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        n_routed_experts=256,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        index_topk=512,
        hc_mult=4,
        num_hash_layers=3,
        dspark_block_size=5,
        dspark_target_layer_ids=[40, 41, 42],
    )
    assert {key: DSV4_FLASH[key] for key in published} == published
    ratios = DSV4_FLASH["compress_ratios"]
    assert len(ratios) == 43 + DSPARK_LAYERS and ratios[43:] == [0] * DSPARK_LAYERS
    assert ratios[:2] == [0, 0] and set(ratios[2:43]) == {4, 128}


def test_weight_count_matches_the_published_checkpoint():
    """The count, run on the full model, comes within 0.1% of the checkpoint's bytes."""
    total = sum(deepseek_v4_weight_bytes(DSV4_FLASH).values())
    assert abs(total - FLASH_0731_CHECKPOINT_BYTES) < 1e-3 * FLASH_0731_CHECKPOINT_BYTES


@pytest.mark.parametrize("shape", sorted(DSV4))
def test_shape_config_is_consistent(shape):
    config = deepseek_v4_config(shape)
    layers = config["num_hidden_layers"]
    assert len(config["compress_ratios"]) == layers + DSPARK_LAYERS
    assert set(config["compress_ratios"]) <= {0, 4, 128}
    assert all(0 <= i < layers for i in config["dspark_target_layer_ids"])
    assert config["dspark_noise_token_id"] < config["vocab_size"]
    assert config["num_experts_per_tok"] <= config["n_routed_experts"]
    assert config["num_hash_layers"] < layers


def test_reduced_shape_keeps_every_layer_and_fits_one_gpu():
    reduced = deepseek_v4_config("dsv4-flash-reduced")
    assert {k: v for k, v in reduced.items() if k != "n_routed_experts"} == {
        k: v for k, v in DSV4_FLASH.items() if k != "n_routed_experts"
    }
    assert reduced["n_routed_experts"] == 64
    assert sum(deepseek_v4_weight_bytes(reduced).values()) <= 60e9


@pytest.fixture(scope="module")
def probed() -> dict:
    from subprocess_probe import run_probe

    return run_probe(Path(__file__), *sorted(DSV4), timeout=1200)


def test_building_the_config_imports_attention_before_breakable_graphs_are_on(probed):
    """vLLM 0.26.0 turns breakable CUDA graphs on for DeepSeek-V4 (VLLM_USE_BREAKABLE_
    CUDAGRAPH=1) only once its config is built, but building the model config already
    imported the model's modules (``get_quantization_config`` imports
    ``vllm.models.deepseek_v4``), whose attention was then decorated with the graphs off:
    in this process, and in an engine core forked from it, attention stays inside the
    PIECEWISE graphs (docs/design/deepseek-v4.md), until the plugin's patch decorates it
    again. When this fails, vLLM changed."""
    assert probed["breakable"] == {
        "env_before_config": None,
        "attention_imported_before_config": False,
        "env_after_config": "1",
        "attention_breaks_graphs": False,
        # patches/dsv4_breakable_attention.py decorates it again, once.
        "attention_breaks_graphs_patched": True,
    }


@pytest.mark.parametrize("shape", sorted(DSV4))
def test_vllm_builds_the_target_with_its_dspark_module(shape, probed):
    config = deepseek_v4_config(shape)
    found = probed[shape]
    assert found["architectures"] == ["DeepseekV4ForCausalLM"]
    assert found["quantization"] == "deepseek_v4_fp8"
    assert found["draft_architectures"] == ["DSparkDraftModel"]
    assert found["draft_model_is_target"] and found["num_speculative_tokens"] == NUM_DRAFTS
    assert found["dspark_target_layer_ids"] == config["dspark_target_layer_ids"]
    assert found["routed_experts"] == config["n_routed_experts"]
    layers = config["num_hidden_layers"]
    ratios = config["compress_ratios"]
    assert found["target_layers"] == [
        {
            "compressor": ratios[i] > 1,
            "indexer": ratios[i] == 4,
            "hash_routed": i < config["num_hash_layers"],
            "selection_bias": i >= config["num_hash_layers"],
        }
        for i in range(layers)
    ]
    # The drafter's layers follow the target's and run a sliding window only.
    plain = {"compressor": False, "indexer": False, "hash_routed": False, "selection_bias": True}
    assert found["draft_layers"] == [plain] * DSPARK_LAYERS
    assert found["draft_shares_embedding"]


def test_routing_simulation_replaces_every_router(probed):
    last = sorted(DSV4)[-1]
    layers = deepseek_v4_config(last)["num_hidden_layers"]
    assert probed["simulated_routers"] == ["RoutingSimulatorRouter"] * layers


def test_dummy_weights_finish_the_first_layer_only_through_the_extension(probed):
    """vLLM's dummy load leaves the first layer's summed hyper-connection weights unset (its
    first forward asserts them); the benchmarks' worker extension sets them."""
    last = deepseek_v4_config(sorted(DSV4)[-1])
    mix = (2 + last["hc_mult"]) * last["hc_mult"]
    assert probed["dummy_hc_broadcast"] == {
        "stock": None,
        "extension": [[mix, last["hidden_size"]], last["hidden_size"]],
    }


@pytest.mark.parametrize("shape", sorted(DSV4))
def test_weight_count_is_what_vllm_allocates(shape, probed):
    assert probed[shape]["weight_bytes"] == deepseek_v4_weight_bytes(deepseek_v4_config(shape))


def test_dummy_weights_route_every_token_alike_unless_routing_is_simulated():
    """vLLM's dummy weights draw the router's weights and its selection bias alike from
    +-1e-3; the router's input, an RMS norm with dummy weights, is as small, so scores
    differ between tokens far less than the bias between experts, and DeepSeek-V4's
    router (vLLM's reference of it) sends a whole batch to the bias's top experts. vLLM's
    routing simulation, which the dummy shapes are timed with, spreads a batch over the
    experts as balanced routing would."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import (
        _topk_softplus_sqrt_torch,
    )
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulator,
    )

    config = deepseek_v4_config("dsv4-flash-reduced")
    experts, top_k, hidden = (
        config["n_routed_experts"],
        config["num_experts_per_tok"],
        config["hidden_size"],
    )
    tokens = 128
    generator = torch.Generator().manual_seed(0)

    def dummy(*shape):
        return torch.rand(*shape, generator=generator) * 2e-3 - 1e-3

    router_input = torch.randn(tokens, hidden, generator=generator) * dummy(hidden)
    logits = router_input @ dummy(experts, hidden).T
    weights = torch.empty(tokens, top_k)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    _topk_softplus_sqrt_torch(
        weights, ids, torch.empty_like(ids), logits, True, e_score_correction_bias=dummy(experts)
    )
    assert ids.unique().numel() <= 2 * top_k
    _, simulated = RoutingSimulator.simulate_routing(
        router_input, logits, "uniform_random", top_k, torch.int64
    )
    assert simulated.unique().numel() >= 0.9 * experts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _layer_kinds(layers) -> list[dict]:
    return [
        {
            "compressor": layer.attn.compressor is not None,
            "indexer": layer.attn.indexer is not None,
            "hash_routed": layer.ffn.gate.tid2eid is not None,
            "selection_bias": layer.ffn.gate.e_score_correction_bias is not None,
        }
        for layer in layers
    ]


def _probe(shapes: list[str]) -> dict:
    """Build each shape's engine config with DSpark and its target and drafter on the meta
    device; report what vLLM resolved and the bytes of their parameters."""
    from vllm_cpu import select_cpu_platform

    select_cpu_platform()
    import torch
    import vllm.config.vllm as vllm_config_module

    vllm_config_module.HAS_TRITON = True  # DSpark's V2 runner checks for it; no kernel runs
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import fp8, mxfp4
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import set_default_torch_dtype

    class NoStream:
        def __init__(self, *args, **kwargs):
            pass

    torch.cuda.Stream = torch.cuda.Event = NoStream
    current_platform.get_device_capability = lambda device_id=0: DeviceCapability(9, 0)
    fp8.init_fp8_linear_kernel = lambda **kwargs: None  # chosen per GPU, after the weights
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.MARLIN, None)

    def engine_config(folder: str, **speculative):
        return EngineArgs(
            model=folder,
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=4096,
            kv_cache_dtype="fp8",
            block_size=256,
            **speculative,
        ).create_engine_config()

    root = Path(tempfile.mkdtemp())
    report = {}
    attention = "vllm.models.deepseek_v4.attention"
    breakable = {
        "env_before_config": os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH"),
        "attention_imported_before_config": attention in sys.modules,
    }
    for index, shape in enumerate(shapes):
        folder = write_deepseek_v4_shape(shape, root)
        config = engine_config(
            folder,
            speculative_config={"method": "dspark", "num_speculative_tokens": NUM_DRAFTS},
        )
        if index == 0:
            from vllm_dspark.patches import dsv4_breakable_attention

            layer = sys.modules[attention].DeepseekV4Attention
            report["breakable"] = breakable | {
                "env_after_config": os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH"),
                "attention_breaks_graphs": hasattr(layer.attention_impl, "__wrapped__"),
            }
            dsv4_breakable_attention.apply()
            patched = layer.attention_impl
            dsv4_breakable_attention.apply()  # idempotent
            report["breakable"]["attention_breaks_graphs_patched"] = (
                hasattr(patched, "__wrapped__") and layer.attention_impl is patched
            )
        with set_current_vllm_config(config):
            if index == 0:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    backend="gloo",
                )
                initialize_model_parallel(1, 1)
            from vllm.models.deepseek_v4 import (
                DeepseekV4ForCausalLM,
                DSparkDeepseekV4ForCausalLM,
            )

            with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"):
                target = DeepseekV4ForCausalLM(vllm_config=config, prefix="")
                draft = DSparkDeepseekV4ForCausalLM(vllm_config=config, prefix="")

        def size(module, skip=()):
            return sum(
                p.numel() * p.element_size()
                for name, p in module.named_parameters()
                if name not in skip
            )

        shared = ("model.embed_tokens.weight", "lm_head.weight")
        embedding = size(target) - size(target, skip=shared)
        spec = config.speculative_config
        report[shape] = {
            "architectures": config.model_config.architectures,
            "quantization": config.model_config.quantization,
            "draft_architectures": spec.draft_model_config.architectures,
            "draft_model_is_target": spec.model == folder,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "dspark_target_layer_ids": list(draft.model.target_layer_ids),
            "routed_experts": target.model.layers[0].ffn.n_routed_experts,
            "target_layers": _layer_kinds(target.model.layers),
            "draft_layers": _layer_kinds(draft.model.layers),
            "draft_shares_embedding": not DSparkDeepseekV4ForCausalLM.has_own_embed_tokens
            and not DSparkDeepseekV4ForCausalLM.has_own_lm_head,
            "weight_bytes": {
                "embedding": embedding,
                "target_layers": size(target) - embedding,
                "dspark": size(draft, skip=shared),
            },
        }
    report["dummy_hc_broadcast"] = _dummy_hc_broadcast(lambda: engine_config(folder))
    # The routing a timed run of a dummy shape asks for (docs/design/deepseek-v4.md).
    os.environ["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = "uniform_random"
    config = engine_config(folder)
    with set_current_vllm_config(config), torch.device("meta"):
        simulated = DeepseekV4ForCausalLM(vllm_config=config, prefix="")
    report["simulated_routers"] = [
        type(layer.ffn.experts.router).__name__ for layer in simulated.model.layers
    ]
    return report


def _dummy_hc_broadcast(engine_config) -> dict:
    """The first layer's summed hyper-connection weights after vLLM's dummy load, stock
    and through the benchmarks' worker extension (None: not set)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dspark.patches.wrapping import original

    def broadcast_after(load_weights):
        config = engine_config()  # a fresh one: a config registers each layer's name once
        with (
            set_current_vllm_config(config),
            set_default_torch_dtype(config.model_config.dtype),
            torch.device("meta"),
        ):
            model = DeepseekV4ForCausalLM(vllm_config=config, prefix="")
            load_weights(
                DummyModelLoader(LoadConfig(load_format="dummy")), model, config.model_config
            )
        layer = model.model.layers[0]
        broadcast = layer.hc_attn_fn_broadcast
        return None if broadcast is None else [list(broadcast.shape), layer.hidden_size]

    import vllm_dspark.bench.dummy_weights  # noqa: F401  (what naming the extension does)

    return {
        "stock": broadcast_after(original(DummyModelLoader, "load_weights")),
        "extension": broadcast_after(DummyModelLoader.load_weights),
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(_probe(sys.argv[1:])), flush=True)
