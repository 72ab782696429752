"""Greedy speculative decoding with the tiny pair, simulated in PyTorch.

Greedy verification is lossless, so the committed text is the target's own greedy
continuation whatever the drafts are. The simulation therefore generates that
continuation once, runs one target forward over it (the drafter's context at every
position) and one drafter pass over every anchor, then walks the verify steps: from anchor
``p`` the drafts ``d_1..d_K`` are checked against the continuation, ``a`` leading matches
are accepted and the next anchor is ``p + a + 1`` (the target's bonus token). Each verify
step records the confidence logits and the per-position matches, which feed STS fitting
and the AUROC / ECE report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dspark.capacity.confidence import draft_statistics
from vllm_dspark.tiny_pair.drafter import DrafterConfig, DSparkDrafter, SharedTargetWeights
from vllm_dspark.tiny_pair.target import generate_continuations, target_features

from .calibration import fit_position_heads
from .progress import progress_bar


@dataclass
class EvalConfig:
    prompt_len: int = 64
    # The demo's and the benchmarks' output length: the first tokens of a continuation are
    # drafted less well (position-1 acceptance 0.81 over 128 tokens, 0.85 over 256), and
    # STS fits the calibration of the workload it is measured on.
    new_tokens: int = 128
    num_calibration_prompts: int = 512
    num_test_prompts: int = 512
    generation_batch: int = 256
    draft_batch: int = 16  # sequences per drafter pass (all their anchors at once)
    # Refit the confidence head on the calibration split's verify steps before STS: one row
    # per position over [h ; markov ; l ; log(1 - e^l)] (see refit_position_heads).
    refit_confidence_head: bool = True


@dataclass
class VerifyRecords:
    """One row per simulated verify step."""

    confidence_logits: np.ndarray  # [steps, K] float
    accepted: np.ndarray  # [steps, K] bool, draft k equals the target's token
    acceptance_lengths: np.ndarray  # [steps] 1 + accepted drafts
    draft_logprob: np.ndarray  # [steps, K] top-1 log-probability of each draft distribution
    # [steps, K, hidden + markov_rank] float32: the confidence head's inputs, if kept
    confidence_inputs: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return int(self.acceptance_lengths.size)


def sample_prompts(
    tokens: np.ndarray, count: int, length: int, rng: np.random.Generator
) -> np.ndarray:
    """``count`` random windows of ``length`` tokens from a flat token array."""
    starts = rng.integers(0, tokens.size - length, size=count)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int64)


def greedy_sequences(
    target, prompts: np.ndarray, new_tokens: int, batch: int, device: torch.device
) -> torch.Tensor:
    """The target's greedy continuations of ``prompts`` (prompt tokens included)."""
    outputs = []
    for start in progress_bar(iterable=range(0, len(prompts), batch), desc="greedy continuations"):
        chunk = torch.as_tensor(prompts[start : start + batch], device=device)
        outputs.append(generate_continuations(target, chunk, new_tokens, greedy=True).cpu())
    return torch.cat(outputs)


def accepted_prefix_length(matches: np.ndarray) -> int:
    """Number of leading True values."""
    return int(np.argmin(matches)) if not matches.all() else int(matches.size)


def greedy_walk(matches: np.ndarray) -> Iterator[tuple[int, int]]:
    """(anchor, drafts accepted) of each verify step greedy speculative decoding of one
    sequence takes, from anchor 0 until its anchors run out: a step commits its accepted
    drafts and the target's own token. ``matches[i, k]``: draft k + 1 from anchor i is the
    target's token."""
    anchor = 0
    while anchor < len(matches):
        accepted = accepted_prefix_length(matches[anchor])
        yield anchor, accepted
        anchor += accepted + 1


@torch.no_grad()
def simulate_verify_steps(
    target,
    drafter: DSparkDrafter,
    sequences: torch.Tensor,
    prompt_len: int,
    draft_batch: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    keep_confidence_inputs: bool = False,
) -> VerifyRecords:
    """Walk greedy speculative decoding over each sequence's continuation."""
    block_size = drafter.config.block_size
    layer_ids = drafter.config.target_layer_ids
    shared = SharedTargetWeights(target.model.embed_tokens.weight, target.lm_head.weight)
    seq_len = sequences.shape[1]
    # Anchor p is judged on the tokens at p+1..p+K, which must exist.
    anchors = torch.arange(prompt_len, seq_len - block_size, device=device)
    offsets = torch.arange(1, block_size + 1, device=device)
    logits_rows, matches_rows, lengths, input_rows, logprob_rows = [], [], [], [], []
    for start in progress_bar(iterable=range(0, len(sequences), draft_batch), desc="drafting"):
        seqs = sequences[start : start + draft_batch].to(device)
        batch_anchors = anchors.expand(len(seqs), -1)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            features = target_features(target, seqs, layer_ids)
            proposal = drafter.propose(
                features.aux_hidden,
                batch_anchors,
                seqs[:, anchors],
                shared,
                keep_confidence_inputs=keep_confidence_inputs,
            )
        truth = seqs[:, anchors[:, None] + offsets]  # [b, A, K]
        matches = (proposal.tokens == truth).cpu().numpy()
        confidence = proposal.confidence_logits.cpu().numpy()
        logprob = proposal.draft_logprob.cpu().numpy()
        inputs = proposal.confidence_inputs.cpu().numpy() if keep_confidence_inputs else None
        for b in range(len(seqs)):
            for i, accepted in greedy_walk(matches[b]):
                logits_rows.append(confidence[b, i])
                logprob_rows.append(logprob[b, i])
                matches_rows.append(matches[b, i])
                lengths.append(accepted + 1)
                if inputs is not None:
                    input_rows.append(inputs[b, i])
    return VerifyRecords(
        confidence_logits=np.asarray(logits_rows, dtype=np.float64),
        accepted=np.asarray(matches_rows, dtype=bool),
        acceptance_lengths=np.asarray(lengths, dtype=np.int64),
        draft_logprob=np.asarray(logprob_rows, dtype=np.float64),
        confidence_inputs=np.stack(input_rows) if input_rows else None,
    )


def verify_records(
    target, drafter: DSparkDrafter, prompts: np.ndarray, new_tokens: int, keep_inputs: bool
) -> tuple[VerifyRecords, np.ndarray]:
    """Greedy verify steps over ``prompts`` [n, length] on CPU in float32, and the prompt
    each step belongs to."""
    device = torch.device("cpu")
    length = prompts.shape[1]
    sequences = greedy_sequences(target, prompts, new_tokens, 64, device)
    records = simulate_verify_steps(
        target, drafter, sequences, length, 16, device, None, keep_confidence_inputs=keep_inputs
    )
    # Steps come sequence by sequence; each advances its sequence by its acceptance length.
    end = sequences.shape[1] - records.accepted.shape[1]
    prompt_of_step, prompt, position = [], 0, length
    for advance in records.acceptance_lengths:
        prompt_of_step.append(prompt)
        position += int(advance)
        if position >= end:
            prompt, position = prompt + 1, length
    assert prompt == len(prompts), (prompt, len(prompts))  # every sequence walked to its end
    return records, np.array(prompt_of_step)


def acceptance_report(records: VerifyRecords) -> dict:
    """Mean acceptance length and per-position acceptance of a set of verify steps."""
    survived = np.cumprod(records.accepted, axis=1).astype(bool)
    reached = np.concatenate([np.ones((records.num_steps, 1), bool), survived[:, :-1]], axis=1)
    conditional = [
        float(records.accepted[reached[:, k], k].mean()) if reached[:, k].any() else None
        for k in range(records.accepted.shape[1])
    ]
    return {
        "verify_steps": records.num_steps,
        "mean_acceptance_length": float(records.acceptance_lengths.mean()),
        "acceptance_rate_conditional": conditional,
        "survival_rate": survived.mean(axis=0).tolist(),
    }


def position_head_inputs(records: VerifyRecords, hidden_and_rank: int) -> np.ndarray:
    """[steps, K, hidden + rank + 2]: the refitted head's inputs, [h ; markov ; l ; log(1 -
    e^l)], from records kept with their confidence inputs (whatever head drafted them)."""
    statistics = draft_statistics(torch.as_tensor(records.draft_logprob), True, True).numpy()
    return np.concatenate([records.confidence_inputs[..., :hidden_and_rank], statistics], -1)


def refit_position_heads(records: VerifyRecords, hidden_and_rank: int) -> dict:
    """The confidence head refitted on ``records``: weight [K, D] and bias [K], float32.

    Why this form: with one row shared by every position and [h ; markov ; l] as inputs,
    no choice of temperatures brought the embedded pair's survival ECE at position 2 under
    0.042 (``benchmarks/results/sts_ceiling.json``); log(1 - e^l) lets the logit follow
    the top-1's log-odds and a row per position fits each position's calibration
    (``benchmarks/results/confidence_head_refit.json``)."""
    inputs = position_head_inputs(records, hidden_and_rank)
    weight, bias = fit_position_heads(inputs, records.accepted)
    return {
        "weight": torch.as_tensor(weight, dtype=torch.float32),
        "bias": torch.as_tensor(bias, dtype=torch.float32),
    }


def head_logits(records: VerifyRecords, head: dict, hidden_and_rank: int) -> np.ndarray:
    """[steps, K] confidence logits of a refitted head, in float64."""
    inputs = position_head_inputs(records, hidden_and_rank)
    weight = head["weight"].double().numpy()
    return np.einsum("nkd,kd->nk", inputs, weight) + head["bias"].double().numpy()


def with_position_heads(config: DrafterConfig) -> DrafterConfig:
    """``config`` with the confidence head :func:`refit_position_heads` makes."""
    return dataclasses.replace(
        config,
        confidence_draft_logprob=True,
        confidence_draft_miss_logprob=True,
        confidence_head_rows=config.block_size,
    )
