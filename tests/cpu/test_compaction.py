import pytest
import torch

from vllm_dspark.capacity.allocation import admission_budget, budget_capacity
from vllm_dspark.verify.compaction import compact_layout, compact_seq_lens, compact_tokens

K = 3


def expected_compact(uniform: torch.Tensor, capacity: list[int]) -> list[int]:
    out = []
    for r, k in enumerate(capacity):
        out += uniform[r * (1 + K) : r * (1 + K) + 1 + k].tolist()
    return out


@pytest.mark.parametrize("capacity", [[2, 0, 3], [0, 0, 0], [3, 3, 3], [1, 3, 0, 2, 0]])
def test_compact_layout_packs_each_requests_admitted_prefix(capacity):
    num_reqs = len(capacity)
    uniform_ids = torch.arange(100, 100 + num_reqs * (1 + K))
    total = num_reqs + sum(capacity)
    layout = compact_layout(torch.tensor(capacity), K, total)
    assert compact_tokens(uniform_ids, layout).tolist() == expected_compact(uniform_ids, capacity)
    lengths = [1 + k for k in capacity]
    assert layout.query_start_loc.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert layout.request.tolist() == [r for r, n in enumerate(lengths) for _ in range(n)]
    assert layout.offset.tolist() == [j for n in lengths for j in range(n)]


def test_slot_mappings_of_every_kv_group_are_compacted_together():
    capacity = torch.tensor([1, 2])
    slots = torch.arange(2 * 2 * (1 + K)).view(2, -1)  # two KV groups
    layout = compact_layout(capacity, K, 2 + 3)
    assert compact_tokens(slots, layout).tolist() == [[0, 1, 4, 5, 6], [8, 9, 12, 13, 14]]


def test_sequence_lengths_lose_the_unverified_drafts():
    # Uniform seq_len = computed + 1 + K.
    seq_lens = torch.tensor([10 + 1 + K, 20 + 1 + K], dtype=torch.int32)
    layout = compact_layout(torch.tensor([0, 2]), K, 2 + 2)
    assert compact_seq_lens(seq_lens, layout).tolist() == [11, 23]


def test_budget_admission_fixes_the_total_the_host_knows():
    gen = torch.Generator().manual_seed(0)
    survival = torch.cumprod(torch.rand(6, K, generator=gen), dim=1)
    budget = admission_budget(6, K, 0.5)
    capacity = budget_capacity(survival, budget)
    assert int(capacity.sum()) == budget
    layout = compact_layout(capacity, K, 6 + budget)
    assert int(layout.query_start_loc[-1]) == 6 + budget
