"""The compaction kernel writes what the PyTorch compact layout says (Triton's interpreter,
:mod:`triton_interpreter`)."""

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.verify.compaction import compact_layout, compact_seq_lens

K, MAX_NUM_REQS = 7, 24
NUM_REQS = [1, 2, 5, 16, 23, MAX_NUM_REQS]


def test_kernel_under_triton_interpreter():
    assert run_interpreted(__file__) == len(NUM_REQS)


def uniform_buffers(num_reqs: int, generator: torch.Generator) -> dict:
    """The runner's buffers holding a uniform decode batch (every request 1 + K tokens),
    with stale values past it that compaction must leave alone or overwrite as told."""
    max_tokens = MAX_NUM_REQS * (1 + K)
    uniform = num_reqs * (1 + K)
    input_ids = torch.randint(0, 1000, (max_tokens,), dtype=torch.int32, generator=generator)
    positions = torch.randint(0, 4000, (max_tokens,), dtype=torch.int64, generator=generator)
    query_start_loc = torch.full((MAX_NUM_REQS + 1,), -5, dtype=torch.int32)
    query_start_loc[: num_reqs + 1] = torch.arange(0, uniform + 1, 1 + K, dtype=torch.int32)
    seq_lens = torch.randint(1 + K, 500, (MAX_NUM_REQS,), dtype=torch.int32, generator=generator)
    return {
        "input_ids": input_ids,
        "positions": positions,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
    }


@interpreted
@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_interpreted_kernel_matches_the_pytorch_layout(num_reqs):
    check_kernel_against_layout(num_reqs, torch.device("cpu"))


def check_kernel_against_layout(num_reqs: int, device: torch.device) -> None:
    """Also run on a GPU by tests/gpu/test_capacity_kernels_gpu.py."""
    from vllm_dspark.verify.compaction_kernel import compact_on_device

    generator = torch.Generator().manual_seed(num_reqs)
    capacity = torch.randint(0, K + 1, (num_reqs,), generator=generator)
    capacity[0] = 0  # a request verifying no draft, and one verifying all of them
    capacity[-1] = K
    num_tokens = num_reqs + int(capacity.sum())
    idx_mapping = torch.randperm(MAX_NUM_REQS, generator=generator)[:num_reqs].int()
    before = uniform_buffers(num_reqs, generator)
    ours = {name: tensor.to(device, copy=True) for name, tensor in before.items()}
    expanded_idx, local_pos, logits_idx = compact_on_device(
        capacity.to(device),
        K,
        num_tokens,
        idx_mapping.to(device),
        **ours,
        max_num_reqs=MAX_NUM_REQS,
    )
    ours = {name: tensor.cpu() for name, tensor in ours.items()}

    layout = compact_layout(capacity, K, num_tokens)
    uniform = num_reqs * (1 + K)
    expected_ids = before["input_ids"].clone()
    expected_ids[:num_tokens] = before["input_ids"][:uniform][layout.source]
    expected_pos = before["positions"].clone()
    expected_pos[:num_tokens] = before["positions"][:uniform][layout.source]
    expected_qsl = torch.full((MAX_NUM_REQS + 1,), num_tokens, dtype=torch.int32)
    expected_qsl[: num_reqs + 1] = layout.query_start_loc
    expected_seq = before["seq_lens"].clone()
    expected_seq[:num_reqs] = compact_seq_lens(before["seq_lens"][:num_reqs], layout)

    # Tokens past the compact batch and sequence lengths past R are left as they were.
    assert torch.equal(ours["input_ids"], expected_ids)
    assert torch.equal(ours["positions"], expected_pos)
    assert torch.equal(ours["query_start_loc"], expected_qsl)
    assert torch.equal(ours["seq_lens"], expected_seq)
    assert torch.equal(expanded_idx.cpu(), idx_mapping[layout.request])
    assert torch.equal(local_pos.cpu(), layout.offset.int())
    assert torch.equal(logits_idx.cpu(), torch.arange(num_tokens))
