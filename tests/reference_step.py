"""A pure-PyTorch speculative step (draft, admit, verify, accept) for CPU tests.

The models are tiny and exact: a bigram target p(x | prev), a bigram drafter
q(x | prev) and a DSpark-like confidence head whose logit reads the *previous* token,
like DSpark's c_k = sigmoid(w . [h_k; W1[x_{k-1}]]). Many independent batches of R
requests run side by side ([batches, R] tensors), so a chi-square test can compare
the output distribution with the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from vllm_dspark.capacity.allocation import (
    UNCOMPUTED_SURVIVAL,
    admission_budget,
    budget_capacity,
    prefix_survival,
    sps_best_count,
    threshold_count,
)

Mode = Literal["off", "threshold", "budget", "sps", "acceptance"]


@dataclass
class ToyPair:
    target_logits: torch.Tensor  # [V, V]: row prev -> logits of the next token
    draft_logits: torch.Tensor  # [V, V]
    confidence_logits: torch.Tensor  # [V]: confidence logit given the previous token

    @classmethod
    def random(cls, vocab: int, seed: int) -> ToyPair:
        gen = torch.Generator().manual_seed(seed)
        target = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64)
        draft = target + 0.8 * torch.randn(vocab, vocab, generator=gen, dtype=torch.float64)
        confidence = 1.5 + 2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64)
        return cls(target, draft, confidence)

    def target_probs(self, prev: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.target_logits[prev], dim=-1)

    def draft_probs(self, prev: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.draft_logits[prev], dim=-1)


@dataclass
class Admission:
    """A capacity mode as served: ``threshold`` and ``sps`` take their budget from the
    previous step's proposals of the same batch, ``acceptance`` its depth from the previous
    step's accepted drafts (stateful across steps)."""

    mode: Mode = "off"
    threshold: float = 0.5
    budget_frac: float = 1.0
    sps_table: torch.Tensor | None = None
    # Test-only: a wrong scheme whose confidence reads the draft it decides about.
    leak_current_draft: bool = False
    # Positions the drafter computes (dynamic depth; 0: the draft gate skipped the
    # proposal); the rest repeat the last draft, drawn from a point mass on it, and are
    # verified only by ``off``, the uncompacted step.
    depth: int | None = None
    # Per batch: drafts per request the previous step's proposals wanted (threshold, sps),
    # or the depth its acceptance asks for (acceptance).
    _wanted_per_request: torch.Tensor | None = field(default=None, init=False, repr=False)
    _depth: torch.Tensor | None = field(default=None, init=False, repr=False)

    def capacity(self, survival: torch.Tensor) -> torch.Tensor:
        """k_r for every request of every batch. [B, R, K] -> [B, R]."""
        num_reqs, num_drafts = survival.shape[-2:]
        cap = admission_budget(num_reqs, num_drafts, self.budget_frac)
        if self.depth is not None:
            cap = min(cap, num_reqs * self.depth)
        if self.mode == "off":
            return torch.full(survival.shape[:-1], num_drafts, dtype=torch.int64)
        if self.mode == "budget":
            return budget_capacity(survival, cap)
        if self.mode == "acceptance":
            if self._depth is None:
                return torch.full(survival.shape[:-1], num_drafts, dtype=torch.int64)
            return self._depth[:, None].expand(survival.shape[:-1])
        budget = torch.full(survival.shape[:-2], cap, dtype=torch.int64)
        if self._wanted_per_request is not None:
            budget = (self._wanted_per_request * num_reqs).round().long().clamp(min(1, cap), cap)
        if self.mode == "threshold":
            wanted = threshold_count(survival, self.threshold)
        else:
            assert self.sps_table is not None, "sps needs a table"
            wanted = sps_best_count(survival, self.sps_table)
        self._wanted_per_request = wanted.double() / num_reqs
        return budget_capacity(survival, budget)

    def after_step(self, count: torch.Tensor, num_drafts: int) -> None:
        """The step's output counts (accepted + 1) [B, R]: acceptance's next depth, a
        function of this step's acceptance alone, clamp(floor(mean accepted + 1.5), 1, K)
        (the served controller weighs the same past, per position, with the SPS curve)."""
        if self.mode == "acceptance":
            mean_accepted = (count - 1).double().mean(dim=-1)
            self._depth = (mean_accepted + 1.5).floor().long().clamp(1, num_drafts)


def _sample(probs: torch.Tensor, gen: torch.Generator, greedy: bool) -> torch.Tensor:
    if greedy:
        return probs.argmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1])


def speculative_step(
    pair: ToyPair,
    last: torch.Tensor,
    num_drafts: int,
    admission: Admission,
    gen: torch.Generator,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for every request: returns (tokens [B, R, K+1], count [B, R]); the first
    ``count`` tokens of each row are the step's output."""
    drafts, draft_probs, conf = [], [], []
    depth = num_drafts if admission.depth is None else admission.depth
    prev = last
    for k in range(num_drafts):
        q = pair.draft_probs(prev)
        if k >= depth:  # not computed: the last draft again, from a point mass on it
            q = torch.nn.functional.one_hot(prev, q.shape[-1]).to(q.dtype)
        token = _sample(q, gen, greedy)
        source = token if admission.leak_current_draft else prev
        conf.append(pair.confidence_logits[source])
        drafts.append(token)
        draft_probs.append(q)
        prev = token
    drafts_t = torch.stack(drafts, dim=-1)  # [B, R, K]
    survival = prefix_survival(torch.stack(conf, dim=-1), torch.ones(num_drafts))
    survival[..., depth:] = UNCOMPUTED_SURVIVAL
    capacity = admission.capacity(survival)

    out = torch.zeros(drafts_t.shape[:-1] + (num_drafts + 1,), dtype=torch.int64)
    count = torch.zeros(drafts_t.shape[:-1], dtype=torch.int64)
    alive = torch.ones_like(count, dtype=torch.bool)  # all verified drafts so far accepted
    prev = last
    for k in range(num_drafts + 1):
        p = pair.target_probs(prev)
        # Requests whose verified prefix ends here emit a bonus sample from p.
        emit = _sample(p, gen, greedy)
        verifying = alive & (capacity > k)
        accept = torch.zeros_like(alive)
        if k < num_drafts:
            token, q = drafts_t[..., k], draft_probs[k]
            if greedy:
                accept = token == emit
            else:
                p_tok = p.gather(-1, token.unsqueeze(-1)).squeeze(-1)
                q_tok = q.gather(-1, token.unsqueeze(-1)).squeeze(-1)
                u = torch.rand(token.shape, generator=gen, dtype=torch.float64)
                accept = u < (p_tok / q_tok).clamp(max=1.0)
                residual = (p - q).clamp(min=0.0)
                residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=1e-300)
                # Verifying requests emit their draft or, on rejection, a residual sample.
                emit = torch.where(verifying, _sample(residual, gen, greedy=False), emit)
            emit = torch.where(verifying & accept, token, emit)
        out[..., k] = torch.where(alive, emit, out[..., k])
        count += alive.long()
        alive = verifying & accept
        prev = emit
    return out, count


def first_tokens(
    pair: ToyPair,
    start: torch.Tensor,
    num_tokens: int,
    num_drafts: int,
    admission: Admission,
    gen: torch.Generator,
    greedy: bool = False,
) -> torch.Tensor:
    """Run steps until every request has ``num_tokens`` output tokens; return them."""
    collected = torch.zeros(start.shape + (num_tokens,), dtype=torch.int64)
    have = torch.zeros(start.shape, dtype=torch.int64)
    last = start
    while bool((have < num_tokens).any()):
        tokens, count = speculative_step(pair, last, num_drafts, admission, gen, greedy)
        admission.after_step(count, num_drafts)
        for j in range(num_drafts + 1):
            slot = have + j
            take = (j < count) & (slot < num_tokens)
            index = slot.clamp(max=num_tokens - 1).unsqueeze(-1)
            current = collected.gather(-1, index).squeeze(-1)
            collected.scatter_(-1, index, torch.where(take, tokens[..., j], current).unsqueeze(-1))
        last = tokens.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
        have += count
    return collected
