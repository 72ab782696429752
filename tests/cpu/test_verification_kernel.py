"""The verification-count kernel computes what its PyTorch definition says (Triton's
interpreter, :mod:`triton_interpreter`; on a GPU, tests/gpu/test_capacity_kernels_gpu.py)."""

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.capacity.verification_kernel import drafted_counts, verification_stats

K, MAX_NUM_REQS = 7, 24
# (requests, positions the proposal computed): full depth, a shallower one, none drafted,
# one request, and a full batch.
CASES = [(5, K), (16, 3), (9, 0), (1, K), (24, 5)]


def test_kernel_under_triton_interpreter():
    assert run_interpreted(__file__) == len(CASES) + 1


def verified_step(num_reqs: int, generator: torch.Generator):
    """cu_num_logits and num_sampled of a step mixing decode requests that verified K
    drafts with prefill chunks (one logit), each decode request accepting a random prefix."""
    prefill = torch.rand(num_reqs, generator=generator) < 0.2
    logits = torch.where(prefill, 1, K + 1)
    cu_num_logits = torch.cat([torch.zeros(1, dtype=torch.int32), logits.cumsum(0).int()])
    num_sampled = (torch.rand(num_reqs, generator=generator) * logits).int() + 1
    return cu_num_logits, num_sampled.int()


def check_kernel_against_definition(case, device: torch.device) -> None:
    """Also run on a GPU by tests/gpu/test_capacity_kernels_gpu.py."""
    num_reqs, depth = case
    cu_num_logits, num_sampled = verified_step(num_reqs, torch.Generator().manual_seed(num_reqs))
    expected = drafted_counts(cu_num_logits, num_sampled, depth, K)
    got = verification_stats(
        cu_num_logits.to(device), num_sampled.to(device), depth, K, MAX_NUM_REQS
    )
    assert got.num_verified.tolist() == expected.num_verified.tolist()
    assert got.num_accepted.tolist() == expected.num_accepted.tolist()
    assert got.position_counts.tolist() == expected.position_counts.tolist()


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_matches_the_definition(case):
    check_kernel_against_definition(case, torch.device("cpu"))


@interpreted
def test_interpreted_kernel_counts_a_known_step():
    # Three decode requests verified K drafts and accepted K, 1 and 0; then a prefill.
    cu_num_logits = torch.tensor([0, 8, 16, 24, 25], dtype=torch.int32)
    num_sampled = torch.tensor([8, 2, 1, 1], dtype=torch.int32)
    definition = drafted_counts(cu_num_logits, num_sampled, 2, K)
    kernel = verification_stats(cu_num_logits, num_sampled, 2, K, MAX_NUM_REQS)
    for counts in (definition, kernel):
        assert counts.num_verified.tolist() == [2, 2, 2, 0]
        assert counts.num_accepted.tolist() == [2, 1, 0, 0]
        reached, accepted = counts.position_counts.split(K)
        assert reached.tolist() == [3, 2] + [0] * (K - 2)
        assert accepted.tolist() == [2, 1] + [0] * (K - 2)
