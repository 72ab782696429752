"""Checks of an exported tiny pair against stock vLLM's own classes (needs vLLM).

:func:`check_pair_against_vllm` builds the engine config vLLM would build for
``method="dspark"``, instantiates vLLM's ``Qwen3DSparkForCausalLM`` and
``Qwen3ForCausalLM``, runs their ``load_weights`` on the exported files and verifies that
every parameter vLLM does not alias from the target was loaded with exactly our values
(fused ``qkv_proj`` / ``gate_up_proj`` included), that the confidence-head tensors are the
only extra names, and that vLLM's RoPE, aux-layer, mask-token and causality settings are
the ones the drafter was trained with. It runs on CPU (nothing is executed but weight
loading and RoPE) and on GPU.

On a machine without a GPU, vLLM's CPU platform must be selected before anything imports
vLLM's config modules (what the tests' ``vllm_cpu`` fixture does: ``tests/vllm_cpu.py``).
"""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_dspark.tiny_pair.drafter import apply_rotary, rotary_cos_sin
from vllm_dspark.tiny_pair.load import CONFIDENCE_PREFIX, drafter_config_from_dict

# Draft parameters vLLM takes from the target (or never uses) instead of the file.
ALIASED_DRAFT_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")
# vLLM fuses these checkpoint tensors into one parameter, in this order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def build_vllm_config(
    target_dir: str | Path, draft_dir: str | Path, num_speculative_tokens: int = 7, **engine_args
):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(target_dir),
        speculative_config={
            "method": "dspark",
            "model": str(draft_dir),
            "num_speculative_tokens": num_speculative_tokens,
        },
        **engine_args,
    ).create_engine_config()


@dataclass
class VllmCheckReport:
    problems: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)  # vLLM draft parameters filled from file
    aliased: list[str] = field(default_factory=list)  # left to vLLM's target aliasing
    skipped_by_vllm: list[str] = field(default_factory=list)  # file tensors vLLM ignores

    @property
    def ok(self) -> bool:
        return not self.problems


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_single_process_groups(vllm_config) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo" if not torch.cuda.is_available() else "nccl",
        )
        parallel_state.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def _constructible_without_kernels():
    """Let SiluAndMul be built where vLLM's compiled CPU kernels are missing.

    Construction only looks the kernel up; nothing here runs the MLP.
    """
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers import activation

    if hasattr(torch.ops._C, "silu_and_mul"):
        yield
        return
    original = activation.SiluAndMul.__init__

    def init_without_kernel(self, *, compile_native: bool = True) -> None:
        CustomOp.__init__(self, compile_native=compile_native)

    activation.SiluAndMul.__init__ = init_without_kernel
    try:
        yield
    finally:
        activation.SiluAndMul.__init__ = original


def _expected_vllm_tensor(
    name: str, ours: dict[str, torch.Tensor], file_prefix_dropped: str
) -> torch.Tensor | None:
    """The value a vLLM parameter should hold, built from our checkpoint tensors."""
    key = name.removeprefix(file_prefix_dropped)
    if key in ours:
        return ours[key]
    for fused, parts in FUSED_PROJECTIONS.items():
        if f".{fused}." in key:
            pieces = [key.replace(f".{fused}.", f".{part}.") for part in parts]
            if all(p in ours for p in pieces):
                return torch.cat([ours[p] for p in pieces], dim=0)
    return None


def _build_model(model_class, vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), _constructible_without_kernels():
        return model_class(vllm_config=vllm_config, prefix="")


def _load_and_compare(
    model,
    vllm_config,
    files: dict[str, torch.Tensor],
    aliased: tuple[str, ...],
    report: VllmCheckReport,
    label: str,
    file_prefix_dropped: str,
) -> None:
    from vllm.config import set_current_vllm_config

    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(files.items()))
    for name, param in model.named_parameters():
        if name in aliased:
            if label == "draft":
                report.aliased.append(name)
            continue
        if torch.isnan(param.float()).any():
            report.problems.append(f"{label}: vLLM parameter {name} was not loaded")
            continue
        expected = _expected_vllm_tensor(name, files, file_prefix_dropped)
        if expected is None:
            report.problems.append(f"{label}: no checkpoint tensor explains {name}")
        elif tuple(expected.shape) != tuple(param.shape):
            report.problems.append(
                f"{label}: {name} has shape {tuple(param.shape)}, file {tuple(expected.shape)}"
            )
        elif not torch.equal(expected.to(param.dtype), param.data):
            report.problems.append(f"{label}: {name} differs from the checkpoint values")
        elif label == "draft":
            report.loaded.append(name)


def check_pair_against_vllm(target_dir: str | Path, draft_dir: str | Path) -> VllmCheckReport:
    """Run the checks of the module docstring; returns a report (``report.ok``)."""
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    report = VllmCheckReport()
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    raw_config = json.loads((draft_dir / "config.json").read_text())
    ours = drafter_config_from_dict(raw_config)
    # float32 so that loaded values compare exactly with the file's.
    vllm_config = build_vllm_config(target_dir, draft_dir, ours.block_size, dtype="float32")
    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config

    expectations = {
        "method": (spec.method, "dspark"),
        "draft architecture": (spec.draft_model_config.architectures, ["Qwen3DSparkModel"]),
        "V2 model runner": (vllm_config.use_v2_model_runner, True),
        "aux hidden layers": (
            get_eagle3_aux_layers_from_config(spec),
            tuple(i + 1 for i in ours.target_layer_ids),
        ),
        "mask token id": (get_parallel_drafting_token_id(hf), ours.mask_token_id),
        "non-causal draft attention": (dflash_has_any_non_causal(hf), True),
        "anchor-as-first-prediction": (getattr(hf, "dspark_bonus_anchor", False), False),
        "rope_theta": (hf.rope_parameters.get("rope_theta"), ours.rope_theta),
        "target vocab": (vllm_config.model_config.get_vocab_size(), ours.vocab_size),
    }
    for what, (got, want) in expectations.items():
        if got != want:
            report.problems.append(f"{what}: vLLM resolves {got!r}, the drafter expects {want!r}")

    _ensure_single_process_groups(vllm_config)
    draft_files = load_file(draft_dir / "model.safetensors")
    confidence = {k: v for k, v in draft_files.items() if k.startswith(CONFIDENCE_PREFIX)}
    report.skipped_by_vllm = sorted(confidence)
    want_shapes = {
        "confidence_head.weight": (ours.confidence_head_rows, ours.confidence_inputs),
        "confidence_head.bias": (ours.confidence_head_rows,),
    }
    for name, shape in want_shapes.items():
        if name not in confidence or tuple(confidence[name].shape) != shape:
            report.problems.append(f"draft: {name} missing or not of shape {shape}")

    draft_model = _build_model(Qwen3DSparkForCausalLM, vllm_config)
    _load_and_compare(
        draft_model, vllm_config, draft_files, ALIASED_DRAFT_PARAMETERS, report, "draft", "model."
    )
    explained = {n.removeprefix("model.") for n in report.loaded}
    for fused, parts in FUSED_PROJECTIONS.items():
        for name in list(explained):
            if f".{fused}." in name:
                explained |= {name.replace(f".{fused}.", f".{p}.") for p in parts}
    unused = set(draft_files) - explained - set(confidence)
    if unused:
        report.problems.append(f"draft: file tensors vLLM does not use: {sorted(unused)}")
    if getattr(draft_model, "has_own_embed_tokens", False) or getattr(
        draft_model, "has_own_lm_head", False
    ):
        report.problems.append("draft: ships its own embed_tokens / lm_head (not shared)")

    attn = draft_model.model.layers[0].self_attn
    positions = torch.arange(37)
    q = torch.randn(37, attn.num_heads * attn.head_dim)
    k = torch.randn(37, attn.num_kv_heads * attn.head_dim)
    vllm_q, vllm_k = attn.rotary_emb.forward_native(positions, q.clone(), k.clone())
    cos, sin = rotary_cos_sin(positions[None], ours.head_dim, ours.rope_theta)
    our_q = apply_rotary(q.view(1, 37, -1, ours.head_dim), cos, sin).reshape(37, -1)
    our_k = apply_rotary(k.view(1, 37, -1, ours.head_dim), cos, sin).reshape(37, -1)
    if not (torch.allclose(vllm_q, our_q, atol=1e-5) and torch.allclose(vllm_k, our_k, atol=1e-5)):
        report.problems.append("RoPE: vLLM's rotary embedding differs from the drafter's")

    target_model = _build_model(Qwen3ForCausalLM, vllm_config)
    tied = ("lm_head.weight",) if vllm_config.model_config.hf_config.tie_word_embeddings else ()
    _load_and_compare(
        target_model,
        vllm_config,
        load_file(target_dir / "model.safetensors"),
        tied,
        report,
        "target",
        file_prefix_dropped="",
    )
    return report
