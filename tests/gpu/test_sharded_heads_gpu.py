"""On a GPU: the FP8 draft heads split over two tensor-parallel ranks (two threads on one
GPU, collectives that exchange their tensors, ``tests/sharded_ranks.py``), over the whole
vocabulary and over a draft vocabulary, draft what one unsharded rank drafts, with the
Triton kernels themselves at the Qwen3-8B head's shape.
The CPU test of the same sharding runs the kernels' PyTorch references
(``tests/cpu/test_vocab_shards.py``)."""

import pytest
import torch
from sharded_ranks import run_ranks, sharded_draft_model

pytest.importorskip("vllm")

from vllm_dspark.config import DSparkOptions  # noqa: E402
from vllm_dspark.head.draft_heads import DraftHeads  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, VOCAB, RANK = 4096, 151936, 256


# The whole vocabulary; every fifth id (a draft vocabulary split over the ranks).
SUBSETS = {"whole": None, "every-fifth": list(range(0, VOCAB, 5))}


@pytest.mark.parametrize("subset", list(SUBSETS))
@pytest.mark.parametrize("rows", [7, 300])  # the Triton tiles, cuBLAS's rowwise GEMM
def test_two_ranks_draft_what_one_rank_drafts(monkeypatch, rows, subset):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, device="cuda", generator=gen) * std

    lm_weight = randn(VOCAB, HIDDEN, std=0.02).bfloat16()
    markov_weight = randn(VOCAB, RANK, std=0.02).bfloat16()
    chosen = SUBSETS[subset]
    ids = torch.arange(VOCAB) if chosen is None else torch.tensor(chosen)
    ids = ids.cuda()
    # Every row mostly along one drafted token's row, in either shard (the last one too):
    # a clear winner, so that no last-bit difference between a shard's GEMM and the whole
    # head's can flip it.
    winners = ids[torch.randint(0, len(ids), (rows,), device="cuda", generator=gen)]
    winners[:3] = ids[torch.tensor([1, len(ids) // 2 + 1, len(ids) - 1])]
    noise = randn(rows, HIDDEN)
    along = lm_weight[winners].float()
    hidden = 0.2 * noise + 0.8 * along * (noise.norm(dim=1) / along.norm(dim=1))[:, None]
    hidden, embed = hidden.bfloat16(), randn(rows, RANK).bfloat16()
    options = DSparkOptions(fp8_draft_head=True, fp8_markov_head=True, draft_vocab=SUBSETS[subset])

    def draft(rank, ranks):
        model = sharded_draft_model(lm_weight, markov_weight, rank, ranks, scale=1.0)
        heads = DraftHeads(model, options, max_rows=rows)
        logits = heads.dspark_logits(hidden) + heads.markov_bias(embed)
        return (
            heads.target_logits(logits),
            heads.to_target(heads.dspark_greedy(logits, hidden, embed)),
            heads.greedy_tokens(hidden),
        )

    (one,) = run_ranks(monkeypatch, 1, lambda rank: draft(rank, 1))  # compiles the kernels
    first, second = run_ranks(monkeypatch, 2, lambda rank: draft(rank, 2))
    for ours, theirs in zip(first, second, strict=True):  # the ranks agree to the bit
        assert torch.equal(ours, theirs)
    logits, rescored, greedy = first
    assert logits.shape == one[0].shape == (rows, VOCAB)
    kept = logits[:, ids].float()
    torch.testing.assert_close(kept, one[0][:, ids].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(rescored, winners) and torch.equal(one[1], winners)
    assert torch.equal(greedy, winners) and torch.equal(one[2], winners)
