"""Reference drafting: the K greedy drafts vLLM's DSpark speculator proposes for a sequence.

For a token sequence ``x_0 .. x_{n-1}`` whose last token is the one the target has just
sampled (vLLM's bonus token, not yet run through the target), vLLM's
``DSparkSpeculator`` uses the target's hidden states at positions ``0 .. n-2`` as context,
puts the query block ``[x_{n-1}, mask, ..., mask]`` at positions ``n-1 .. n+K-2`` and
samples drafts for positions ``n .. n+K-1`` left to right with the Markov bias of the
previous token. :func:`propose_draft_tokens` does the same with our PyTorch drafter, so
its output can be compared token for token with vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3ForCausalLM

from .drafter import DSparkDrafter, SharedTargetWeights, sigmoid
from .load import load_drafter_from_export
from .target import target_features


@dataclass
class ReferenceDraft:
    tokens: list[int]  # K greedy drafts for positions n .. n+K-1
    confidence_logits: list[float]  # raw z_k
    confidences: list[float]  # sigmoid(z_k / T_k) (T = 1 without calibration)
    survival: list[float]  # prefix products of ``confidences``
    margins: list[float]  # top-1 minus top-2 logit per position: how close a tie was


def load_reference_pair(
    export_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Qwen3ForCausalLM, DSparkDrafter, list[float] | None]:
    """Target (transformers) and drafter (ours) from an exported pair, plus STS temperatures."""
    export_dir = Path(export_dir)
    target = Qwen3ForCausalLM.from_pretrained(export_dir / "target", dtype=dtype)
    target = target.to(device).eval().requires_grad_(False)
    drafter, temperatures = load_drafter_from_export(export_dir / "draft")
    return target, drafter.to(device), temperatures


@torch.no_grad()
def propose_draft_tokens(
    target: Qwen3ForCausalLM,
    drafter: DSparkDrafter,
    token_ids: list[int],
    temperatures: list[float] | None = None,
) -> ReferenceDraft:
    """Greedy drafts for ``token_ids`` (at least 2 tokens; the last one is the anchor)."""
    assert len(token_ids) >= 2, "the context needs at least one token before the anchor"
    device = target.lm_head.weight.device
    dtype = target.lm_head.weight.dtype
    ids = torch.as_tensor([token_ids], dtype=torch.long, device=device)
    anchor_position = torch.tensor([[len(token_ids) - 1]], device=device)
    shared = SharedTargetWeights(target.model.embed_tokens.weight, target.lm_head.weight)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(device.type, dtype=dtype, enabled=low_precision):
        features = target_features(target, ids[:, :-1], drafter.config.target_layer_ids)
        proposal = drafter.propose(
            features.aux_hidden, anchor_position, ids[:, -1:], shared, keep_logits=True
        )
    z = proposal.confidence_logits[0, 0].double().cpu().numpy()
    scale = np.ones_like(z) if temperatures is None else np.asarray(temperatures, dtype=float)
    confidences = sigmoid(z / scale)
    top2 = proposal.logits[0, 0].float().topk(2, dim=-1).values
    return ReferenceDraft(
        tokens=proposal.tokens[0, 0].tolist(),
        confidence_logits=z.tolist(),
        confidences=confidences.tolist(),
        survival=np.cumprod(confidences).tolist(),
        margins=(top2[:, 0] - top2[:, 1]).tolist(),
    )
