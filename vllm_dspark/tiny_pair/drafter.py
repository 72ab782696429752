"""The DSpark drafter of the tiny pair, in plain PyTorch.

The math is the one stock vLLM 0.26.0 runs for ``Qwen3DSparkModel`` under the DSpark
speculator, so exported weights draft the same tokens there:

* context: the target's residual stream after each layer in ``target_layer_ids`` (no
  final norm), concatenated, projected by ``fc``; per draft layer ``k_norm(k_proj(
  hidden_norm(ctx)))`` with RoPE at the context positions, and ``v_proj(hidden_norm(
  ctx))`` — no ``input_layernorm`` on the context;
* query block at positions ``p .. p+B-1`` for an anchor at position ``p``: ids
  ``[anchor, mask, ..., mask]`` embedded with the target's embedding, through Qwen3
  decoder layers whose attention sees every context position ``< p`` plus the whole
  block (non-causal inside the block);
* output ``j`` (after the final ``norm``) predicts the token at ``p + 1 + j``: base
  logits from the target's LM head plus the Markov bias ``markov_w2 @ markov_w1[prev]``,
  where ``prev`` is the anchor for ``j = 0`` and the previous draft token after that;
* confidence ``c_j = sigmoid(confidence_head([h_j ; markov_w1[prev]]))``; with
  ``confidence_draft_logprob`` the head also reads ``l_j``, the top-1 log-probability of
  the draft distribution at ``j`` (Markov bias included), and with
  ``confidence_draft_miss_logprob`` ``log(1 - exp(l_j))``: functions of the distribution
  draft ``j`` is sampled from, not of the sampled token, so a capacity decision on ``c_j``
  stays lossless. The head has one output row shared by every position or, with
  ``confidence_head_rows = block_size``, one row per position (row ``j`` scores ``j``).

Parameter names equal the names of the exported draft checkpoint. The target's embedding
and LM head are not parameters of this module: they are passed in, frozen and shared, as
vLLM aliases them from the target.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_dspark.capacity.confidence import draft_statistics, top1_logprob


@dataclass
class DrafterConfig:
    """Shape of the drafter; field names follow the Qwen3 config keys vLLM reads."""

    vocab_size: int
    target_hidden_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    hidden_size: int = 256
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    block_size: int = 7
    markov_rank: int = 32
    # Position weights of the loss: exp(-(k-1)/loss_decay_gamma), k = 1..block_size.
    loss_decay_gamma: float = 4.0
    # The confidence head also reads the draft's top-1 log-probability l and log(1 - e^l)
    # (one more input each); 1 row shared by every position, or block_size rows.
    confidence_draft_logprob: bool = False
    confidence_draft_miss_logprob: bool = False
    confidence_head_rows: int = 1

    @property
    def confidence_inputs(self) -> int:
        return (
            self.hidden_size
            + self.markov_rank
            + int(self.confidence_draft_logprob)
            + int(self.confidence_draft_miss_logprob)
        )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE tables for ``positions`` (any shape): [..., head_dim] each."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, tokens, heads, head_dim]; cos/sin: [batch, tokens, head_dim]."""
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], num_heads, self.head_dim)

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the (already hidden-normed) context: vLLM's precompute_and_store_context_kv."""
        k = self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads))
        v = self._heads(self.v_proj(context), self.num_kv_heads)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        k = torch.cat([context_k, k], dim=1)
        v = torch.cat([context_v, v], dim=1)
        groups = self.num_heads // self.num_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, tokens, head_dim]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None])
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, cos, sin, context_k, context_v, attn_mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank transition bias: ``markov_w2 @ markov_w1[previous token]``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


@dataclass
class SharedTargetWeights:
    """The target's frozen token embedding and LM head (tied in the tiny target)."""

    embedding: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


@dataclass
class BlockOutput:
    hidden: torch.Tensor  # [batch, anchors, block, hidden], after the final norm
    base_logits: torch.Tensor  # [batch, anchors, block, vocab], before the Markov bias


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [batch, anchors, block] greedy draft tokens
    confidence_logits: torch.Tensor  # [batch, anchors, block] float32, before STS
    logits: torch.Tensor | None = field(default=None, repr=False)  # with the Markov bias
    # [batch, anchors, block, config.confidence_inputs]: what the confidence head reads
    confidence_inputs: torch.Tensor | None = field(default=None, repr=False)
    # [batch, anchors, block] float32: top-1 log-probability of each draft distribution
    draft_logprob: torch.Tensor | None = field(default=None, repr=False)


def block_attention_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int
) -> torch.Tensor:
    """Boolean mask [batch, anchors*block, context_len + anchors*block] (True = attend).

    A query of the block of anchor ``p`` sees the context positions ``< p`` and every token
    of its own block — the keys vLLM's draft attention reads (seq_len = p + block).
    """
    batch, num_anchors = anchor_positions.shape
    device = anchor_positions.device
    query_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [b, A*B]
    context = torch.arange(context_len, device=device)
    sees_context = context[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


class DSparkDrafter(nn.Module):
    """Parallel backbone + Markov head + confidence head (see the module docstring)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(
            config.target_hidden_size * len(config.target_layer_ids), config.hidden_size, bias=False
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DraftDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        assert config.confidence_head_rows in (1, config.block_size), "rows: shared or per position"
        self.confidence_head = nn.Linear(config.confidence_inputs, config.confidence_head_rows)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
        # The Markov bias starts at zero, so training starts from the parallel backbone.
        nn.init.zeros_(self.markov_head.markov_w2.weight)
        # Output projections scaled down by depth (GPT-2 style) for a stable start.
        for layer in self.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))

    def backbone(
        self,
        aux_hidden: torch.Tensor,
        anchor_positions: torch.Tensor,
        anchor_tokens: torch.Tensor,
        shared: SharedTargetWeights,
    ) -> BlockOutput:
        """The parallel stage for many anchors at once.

        aux_hidden: [batch, context_len, target_hidden * len(target_layer_ids)], the target's
            hidden states at positions 0..context_len-1, concatenated in target_layer_ids
            order; anchor_positions / anchor_tokens: [batch, anchors]. Anchor ``p`` needs
            ``p <= context_len``.
        """
        cfg = self.config
        batch, num_anchors = anchor_positions.shape
        context_len = aux_hidden.shape[1]
        context = self.hidden_norm(self.fc(aux_hidden))
        context_positions = torch.arange(context_len, device=aux_hidden.device)
        ctx_cos, ctx_sin = rotary_cos_sin(
            context_positions.expand(batch, -1), cfg.head_dim, cfg.rope_theta
        )

        offsets = torch.arange(cfg.block_size, device=anchor_positions.device)
        positions = (anchor_positions[:, :, None] + offsets).flatten(1)  # [b, A*B]
        input_ids = torch.full_like(positions, cfg.mask_token_id)
        input_ids.view(batch, num_anchors, cfg.block_size)[:, :, 0] = anchor_tokens
        x = F.embedding(input_ids, shared.embedding)
        cos, sin = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        mask = block_attention_mask(anchor_positions, context_len, cfg.block_size)

        for layer in self.layers:
            context_k, context_v = layer.self_attn.context_kv(context, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, context_k, context_v, mask)
        hidden = self.norm(x).view(batch, num_anchors, cfg.block_size, -1)
        return BlockOutput(hidden=hidden, base_logits=F.linear(hidden, shared.lm_head))

    def markov_embed(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1(previous_tokens)

    def heads(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        previous_tokens: torch.Tensor,
        confidence_grad_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits with the Markov bias and confidence logits for given previous tokens.

        ``confidence_grad_scale`` scales the confidence loss's gradient into the backbone and
        the Markov embedding (1: joint training as in the paper; 0: the head is a probe);
        the forward values are unchanged.
        """
        logits, confidence_input = self._logits_and_confidence_input(
            hidden, base_logits, previous_tokens
        )
        if confidence_grad_scale != 1.0:
            detached = confidence_input.detach()
            confidence_input = detached + confidence_grad_scale * (confidence_input - detached)
        confidence_logits = self.confidence_head(confidence_input)  # [..., block, rows]
        if self.config.confidence_head_rows > 1:
            return logits, confidence_logits.diagonal(dim1=-2, dim2=-1).float()
        return logits, confidence_logits.squeeze(-1).float()

    def _logits_and_confidence_input(
        self, hidden: torch.Tensor, base_logits: torch.Tensor, previous_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        markov = self.markov_embed(previous_tokens)
        logits = base_logits + self.markov_head.markov_w2(markov)
        # Statistics of the draft distribution, read as fixed inputs (no gradient).
        statistics = draft_statistics(
            top1_logprob(logits.detach()),
            self.config.confidence_draft_logprob,
            self.config.confidence_draft_miss_logprob,
        )
        return logits, torch.cat([hidden, markov, statistics.to(hidden.dtype)], dim=-1)

    @torch.no_grad()
    def propose(
        self,
        aux_hidden: torch.Tensor,
        anchor_positions: torch.Tensor,
        anchor_tokens: torch.Tensor,
        shared: SharedTargetWeights,
        keep_logits: bool = False,
        keep_confidence_inputs: bool = False,
    ) -> DraftProposal:
        """Greedy sequential drafting, as vLLM's DSparkSpeculator._sample_sequential."""
        block = self.backbone(aux_hidden, anchor_positions, anchor_tokens, shared)
        previous = anchor_tokens
        tokens, confidences, all_logits, inputs, logprobs = [], [], [], [], []
        for j in range(self.config.block_size):
            logits, confidence_input = self._logits_and_confidence_input(
                block.hidden[:, :, j], block.base_logits[:, :, j], previous
            )
            if keep_confidence_inputs:
                inputs.append(confidence_input.float())
            row = j if self.config.confidence_head_rows > 1 else 0
            confidences.append(self.confidence_head(confidence_input)[..., row].float())
            logprobs.append(top1_logprob(logits))
            previous = logits.argmax(dim=-1)
            tokens.append(previous)
            if keep_logits:
                all_logits.append(logits)
        return DraftProposal(
            tokens=torch.stack(tokens, dim=2),
            confidence_logits=torch.stack(confidences, dim=2),
            logits=torch.stack(all_logits, dim=2) if keep_logits else None,
            confidence_inputs=torch.stack(inputs, dim=2) if keep_confidence_inputs else None,
            draft_logprob=torch.stack(logprobs, dim=2),
        )


def sigmoid(x: np.ndarray) -> np.ndarray:
    """A confidence logit's probability, in float64 (the tanh form does not overflow)."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))
