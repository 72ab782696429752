"""The FP8 draft heads under tensor parallelism (CPU): two ranks as two threads, each with
its vocabulary shard, joined by collectives that really exchange their tensors.

The FP8 kernels are replaced by their PyTorch references (``fp8_rowwise``; the kernels are
tested against them in ``test_fp8_head.py``), so that what is tested is the sharding: the
shards' padding, the gathered layout, the argmax across ranks and the rescoring's sum.
Every rank must draft what one unsharded rank drafts (on a GPU with the kernels themselves:
``tests/gpu/test_fp8_head_kernel.py``)."""

import pytest
import torch
from sharded_ranks import run_ranks, sharded_draft_model

from vllm_dspark.config import DSparkOptions
from vllm_dspark.head import draft_heads
from vllm_dspark.head.fp8_rowwise import reference_argmax, reference_logits
from vllm_dspark.head.vocab_shards import VocabShard, combine_argmax, gather_logits

H, RANK, V = 16, 4, 45  # vocabulary padded to 48: shards of 24, the last with 21
ROWS = 6


def reference_kernel_logits(x, head, *, vocab_limit, workspace=None, out=None):
    logits = reference_logits(x, head, vocab_limit=vocab_limit, dtype=torch.float32)
    if out is None:
        return logits.to(torch.bfloat16)
    out.fill_(float("-inf"))
    out[:, :vocab_limit] = logits
    return out


def reference_kernel_argmax(x, head, *, vocab_limit, workspace=None):
    return reference_argmax(x, head, vocab_limit=vocab_limit, dtype=torch.float32)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(draft_heads, "check_fp8_supported", lambda option, weight: None)
    monkeypatch.setattr(draft_heads, "fp8_head_logits", reference_kernel_logits)
    monkeypatch.setattr(draft_heads, "fp8_head_argmax", reference_kernel_argmax)


def test_every_rank_drafts_what_one_unsharded_rank_drafts(monkeypatch, fp8_on_cpu):
    gen = torch.Generator().manual_seed(0)
    lm_weight = (torch.randn(V, H, generator=gen) * 0.1).bfloat16()
    markov_weight = (torch.randn(V, RANK, generator=gen) * 0.1).bfloat16()
    hidden = (torch.randn(ROWS, H, generator=gen) * 3).bfloat16()
    embed = torch.randn(ROWS, RANK, generator=gen).bfloat16()
    hidden[1] = lm_weight[44].float() * 40  # a row whose best token is in the last shard
    options = DSparkOptions(fp8_draft_head=True, fp8_markov_head=True)

    def draft(rank, ranks):
        heads = draft_heads.DraftHeads(
            sharded_draft_model(lm_weight, markov_weight, rank, ranks), options, max_rows=ROWS
        )
        assert (heads.shard is None) == (ranks == 1)
        logits = heads.dspark_logits(hidden) + heads.markov_bias(embed)
        return logits, heads.dspark_greedy(logits, hidden, embed), heads.greedy_tokens(hidden)

    (one,) = run_ranks(monkeypatch, 1, lambda rank: draft(rank, 1))
    two = run_ranks(monkeypatch, 2, lambda rank: draft(rank, 2))
    assert one[0].shape == (ROWS, V) and one[2][1] == 44
    for rank_result in two:
        for ours, unsharded in zip(rank_result, one, strict=True):
            assert torch.equal(ours, unsharded)


@pytest.mark.parametrize(
    "subset",
    # Even over both shards; 3 and 1 (rank 1's block padded); rank 0's rows alone.
    [[1, 4, 9, 16, 25, 30, 40, 44], [1, 4, 9, 30], [0, 3, 7, 20]],
    ids=["spread", "uneven", "one-shard"],
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_draft_vocabulary_over_the_ranks_drafts_as_one_rank(monkeypatch, fp8_on_cpu, subset, fp8):
    gen = torch.Generator().manual_seed(2)
    lm_weight = (torch.randn(V, H, generator=gen) * 0.1).bfloat16()
    markov_weight = (torch.randn(V, RANK, generator=gen) * 0.1).bfloat16()
    hidden = (torch.randn(ROWS, H, generator=gen) * 3).bfloat16()
    embed = torch.randn(ROWS, RANK, generator=gen).bfloat16()
    hidden[1] = lm_weight[subset[-1]].float() * 40  # the subset's last token wins row 1
    # Every token of the subset below zero in row 2: padding scored 0 would win there.
    hidden[2] = -lm_weight[subset].float().sum(dim=0) * 40
    options = DSparkOptions(draft_vocab=subset, fp8_draft_head=fp8, fp8_markov_head=fp8)

    def draft(rank, ranks):
        heads = draft_heads.DraftHeads(
            sharded_draft_model(lm_weight, markov_weight, rank, ranks), options, max_rows=ROWS
        )
        logits = heads.dspark_logits(hidden) + heads.markov_bias(embed)
        return (
            heads.target_logits(logits),
            heads.to_target(heads.dspark_greedy(logits, hidden, embed)),
            heads.greedy_tokens(hidden),
        )

    (one,) = run_ranks(monkeypatch, 1, lambda rank: draft(rank, 1))
    two = run_ranks(monkeypatch, 2, lambda rank: draft(rank, 2))
    assert one[0].shape == (ROWS, V) and one[2][1] == subset[-1]
    outside = torch.ones(V, dtype=torch.bool)
    outside[subset] = False
    assert (one[0][:, outside] == float("-inf")).all()
    for rank_result in two:
        for ours, unsharded in zip(rank_result, one, strict=True):
            assert torch.equal(ours, unsharded)


def test_the_argmax_across_ranks_keeps_the_lowest_id_and_skips_non_finite_rows():
    shards = [VocabShard(start=0, valid=4, size=4, vocab=7), VocabShard(4, 3, 4, 7)]
    # Per rank: local index and value of rows 0-2. Row 0: a tie across ranks (the lower id
    # wins); row 1: rank 0 had a NaN (-1), rank 1 decides; row 2: no rank finite -> token 0.
    index = [torch.tensor([2, -1, -1]), torch.tensor([1, 0, -1])]
    value = [torch.tensor([5.0, float("nan"), float("nan")]), torch.tensor([5.0, -3.0, 1.0])]
    # What each rank hands the all-gather, then the combination both ranks compute alike.
    sent = []
    for rank in range(2):

        def record(tensor, dim):
            sent.append(tensor)
            return torch.cat([tensor, tensor], dim=dim)  # a stand-in; its result is not read

        combine_argmax(index[rank], value[rank], shards[rank], record)
    both = torch.cat(sent, dim=-1)
    for rank in range(2):
        tokens = combine_argmax(index[rank], value[rank], shards[rank], lambda t, d: both)
        assert tokens.tolist() == [2, 4, 0]


def test_gathered_logits_are_cut_to_the_vocabulary():
    shard = VocabShard(start=4, valid=3, size=4, vocab=7)
    local = torch.tensor([[1.0, 2.0, 3.0, float("-inf")]])
    other = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    logits = gather_logits(local, shard, lambda t, dim: torch.cat([other, t], dim=dim))
    assert logits.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0]]
