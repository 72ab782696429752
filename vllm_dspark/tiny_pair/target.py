"""The tiny target: a transformers ``Qwen3ForCausalLM``, and what the drafter reads from it.

vLLM feeds a DSpark drafter, for ``target_layer_ids = [i, ...]``, the residual stream
``hidden_states + residual`` right after decoder layer ``i`` (its aux layer ``i + 1``),
without the final norm. In transformers that is the output of ``model.layers[i]``, which
:func:`target_features` captures with forward hooks (the last entry of transformers'
``hidden_states`` tuple is normed, so it is not used).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM


@dataclass
class TargetConfig:
    """Shape of the target; field names are Qwen3Config's."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def to_hf(self, eos_token_id: int | None, pad_token_id: int | None) -> Qwen3Config:
        fields = asdict(self)
        rope_theta = fields.pop("rope_theta")
        return Qwen3Config(
            **fields,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
            hidden_act="silu",
            bos_token_id=None,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )


def build_target(config: TargetConfig) -> Qwen3ForCausalLM:
    # No eos while training and generating data: continuations run to full length.
    model = Qwen3ForCausalLM(config.to_hf(eos_token_id=None, pad_token_id=None))
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=None)
    return model


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor  # [batch, seq, hidden * len(layer_ids)], pre-norm
    final_hidden: torch.Tensor  # [batch, seq, hidden], after the final norm


def _layer_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def target_features(
    target: Qwen3ForCausalLM, input_ids: torch.Tensor, layer_ids: list[int]
) -> TargetFeatures:
    """One causal forward over ``input_ids``: the drafter's context and the final hidden."""
    assert list(layer_ids) == sorted(layer_ids), "vLLM concatenates aux states in layer order"
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: captured.__setitem__(i, _layer_output(out))
        )
        for i in layer_ids
    ]
    try:
        final_hidden = target.model(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        for hook in hooks:
            hook.remove()
    return TargetFeatures(
        aux_hidden=torch.cat([captured[i] for i in layer_ids], dim=-1),
        final_hidden=final_hidden,
    )


@torch.no_grad()
def generate_continuations(
    target: Qwen3ForCausalLM,
    prompts: torch.Tensor,
    new_tokens: int,
    greedy: bool,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Prompts [batch, prompt_len] -> [batch, prompt_len + new_tokens]; never stops early."""
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=not greedy,
        temperature=temperature if not greedy else None,
        top_k=0 if not greedy else None,
        top_p=1.0 if not greedy else None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=True,
    )
    out = target.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        generation_config=config,
    )
    assert out.shape[1] == prompts.shape[1] + new_tokens, out.shape
    return out
