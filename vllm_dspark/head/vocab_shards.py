"""The private draft heads under tensor parallelism: one vocabulary shard per rank.

vLLM's ``ParallelLMHead`` splits the padded vocabulary into equal contiguous shards: rank
r holds rows [r*S, (r+1)*S), those below the vocabulary size being tokens (the padding is
the last shard's tail). Stock logits are all-gathered along the vocabulary and cut to its
size; a private FP8 head keeps a quantised copy of its own shard and combines the same
way, or, for a greedy draft, all-gathers one (value, token id) pair per row and rank and
keeps the largest value, ties to the lowest id as one rank's argmax would. Every rank
ends with the same tensors, so all ranks draft the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AllGather = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class VocabShard:
    start: int  # token id of the shard's first row
    valid: int  # rows of the shard that are tokens
    size: int  # rows per shard, padding included (the same on every rank)
    vocab: int  # tokens in all

    @classmethod
    def of(cls, head) -> VocabShard:
        """This rank's shard of a vLLM ``VocabParallelEmbedding`` / ``ParallelLMHead``."""
        indices = head.shard_indices
        return cls(
            start=indices.org_vocab_start_index,
            valid=indices.org_vocab_end_index - indices.org_vocab_start_index,
            size=head.num_embeddings_per_partition,
            vocab=head.org_vocab_size,
        )


def gather_logits(local: torch.Tensor, shard: VocabShard, all_gather: AllGather) -> torch.Tensor:
    """[rows, shard.size] logits of this rank's rows (padding rows at -inf) ->
    [rows, vocab] logits of every token, as vLLM's LogitsProcessor lays them out."""
    return all_gather(local, -1)[:, : shard.vocab]


def combine_argmax(
    index: torch.Tensor, value: torch.Tensor, shard: VocabShard, all_gather: AllGather
) -> torch.Tensor:
    """The token id of the largest logit over every rank, from each rank's shard-local
    argmax (``index`` [rows], -1 for a row without a finite logit; ``value`` [rows]).
    A row no rank has a finite logit for gives token 0, as one rank's argmax does."""
    finite = index >= 0
    ids = torch.where(finite, index + shard.start, 0).double()
    values = torch.where(finite, value.double(), float("-inf"))
    # [rows, 2] per rank -> [rows, 2 * ranks]: (value, id) pairs in rank order.
    pairs = all_gather(torch.stack([values, ids], dim=1), -1).view(index.shape[0], -1, 2)
    # Rank order is id order: argmax keeps the first of equal values, the lowest id.
    best = pairs[..., 0].argmax(dim=1, keepdim=True)
    return pairs[..., 1].gather(1, best).squeeze(1).long()


@dataclass(frozen=True)
class SubsetLayout:
    """A draft vocabulary (``dspark_draft_vocab``) over the ranks: each rank keeps the
    subset's tokens among its shard's rows, padded to the largest rank's count M, so that
    the ranks' logits gather as equal [rows, M] blocks."""

    shard: VocabShard  # the gathered layout: this rank's block, its first `valid` columns real
    local_rows: torch.Tensor  # rows of this rank's head shard the subset keeps [valid]
    ids: torch.Tensor  # token id of each gathered column [ranks * M] (padding repeats one)
    valid: torch.Tensor  # gathered columns that are subset tokens, in id order


def subset_layout(ids: torch.Tensor, shard: VocabShard, rank: int, ranks: int) -> SubsetLayout:
    """``ids``: the subset's token ids, increasing. Every rank computes the same layout."""
    edges = torch.arange(ranks + 1, device=ids.device) * shard.size
    bounds = torch.searchsorted(ids, edges)
    counts = (bounds[1:] - bounds[:-1]).tolist()
    most = max(counts)
    columns = torch.arange(ranks * most, device=ids.device).view(ranks, most)
    real = columns % most < torch.tensor(counts, device=ids.device)[:, None]
    gathered = torch.full((ranks, most), int(ids[0]), dtype=ids.dtype, device=ids.device)
    gathered[real] = ids
    mine = ids[bounds[rank] : bounds[rank + 1]]
    return SubsetLayout(
        shard=VocabShard(start=rank * most, valid=counts[rank], size=most, vocab=ranks * most),
        local_rows=mine - shard.start,
        ids=gathered.flatten(),
        valid=columns[real],
    )
