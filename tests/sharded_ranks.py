"""Tensor-parallel ranks as threads of one process, for the draft heads' sharding tests.

Each thread is a rank with its vocabulary shard of the heads; vLLM's TP functions are
replaced by collectives that really exchange the threads' tensors."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

PAD = 8  # the heads' rows padded to a multiple of this, as vLLM pads to 64


class Collectives:
    """All-gather and all-reduce across threads; each thread sets its ``rank``."""

    def __init__(self, ranks: int):
        self.local = threading.local()
        self.barrier = threading.Barrier(ranks)
        self.slots: list[torch.Tensor | None] = [None] * ranks

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = tensor
        self.barrier.wait()
        tensors = list(self.slots)
        self.barrier.wait()  # all have read before a next call overwrites
        return tensors

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor)).sum(dim=0)


def parallel_head(weight: torch.Tensor, rank: int, ranks: int) -> SimpleNamespace:
    """What DraftHeads reads of a vLLM ParallelLMHead: rank's shard of the padded rows."""
    padded = -(-weight.shape[0] // PAD) * PAD
    size = padded // ranks
    start, end = rank * size, min((rank + 1) * size, weight.shape[0])
    local = weight.new_zeros(size, weight.shape[1])
    local[: end - start] = weight[start:end]
    return SimpleNamespace(
        weight=local,
        shard_indices=SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end),
        num_embeddings_per_partition=size,
        org_vocab_size=weight.shape[0],
    )


def sharded_draft_model(lm_weight, markov_weight, rank: int, ranks: int, scale: float = 0.5):
    """A full-vocabulary DSpark draft model as one rank sees its heads."""
    return SimpleNamespace(
        logits_processor=SimpleNamespace(
            org_vocab_size=lm_weight.shape[0], scale=scale, soft_cap=None
        ),
        lm_head=parallel_head(lm_weight, rank, ranks),
        model=SimpleNamespace(
            markov_head=SimpleNamespace(markov_w2=parallel_head(markov_weight, rank, ranks))
        ),
        draft_id_to_target_id=None,
        map_draft_to_target=lambda ids: ids,
    )


def run_ranks(monkeypatch, ranks: int, work) -> list:
    """``work(rank)`` on every rank at once, vLLM's TP functions answering for the thread."""
    import vllm.distributed

    group = Collectives(ranks)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: ranks)
    monkeypatch.setattr(
        vllm.distributed, "get_tensor_model_parallel_rank", lambda: group.local.rank
    )
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_gather", group.all_gather)
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", group.all_reduce)

    def on_rank(rank):
        group.local.rank = rank
        return work(rank)

    with ThreadPoolExecutor(ranks) as pool:
        return list(pool.map(on_rank, range(ranks)))
