"""The confidence kernel computes what the PyTorch confidence head says (Triton's
interpreter, :mod:`triton_interpreter`; on a GPU, tests/gpu/test_capacity_kernels_gpu.py)."""

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.capacity.confidence import ConfidenceHead

HIDDEN, RANK, K = 96, 24, 3
# (rows, vocabulary, reads the top-1 log-probability, reads its miss log-probability, one
# weight row per position): vocabularies across several of the kernel's blocks, not a
# multiple of one.
CASES = [
    (1, 5000, True, True, True),
    (5, 300, True, False, False),
    (4, 2100, False, True, True),
    (3, 64, False, False, True),
]


def test_kernel_under_triton_interpreter():
    assert run_interpreted(__file__) == len(CASES) + 1


def head_and_inputs(case, device: torch.device):
    """A head with random weights, and one position's inputs as the speculator hands them:
    hidden rows a [R, K, H] slice apart, bf16; logits spread over a wide range, some
    peaked (top-1 near 1, where log(1 - p) is least forgiving), one row with -inf columns
    (a draft vocabulary scattered into the target's)."""
    rows, vocab, logprob, miss, per_position = case
    generator = torch.Generator().manual_seed(rows * vocab)
    inputs = HIDDEN + RANK + int(logprob) + int(miss)
    weight = torch.randn(K if per_position else 1, inputs, generator=generator)
    head = ConfidenceHead(weight, torch.randn(weight.shape[0], generator=generator), logprob, miss)
    hidden = torch.randn(rows, K, HIDDEN, generator=generator).to(torch.bfloat16)
    markov = torch.randn(rows, RANK, generator=generator).to(torch.bfloat16)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[0, 7] = 40.0  # p(top-1) ~ 1
    if rows > 1:
        logits[1, 11] = 9.0  # p(top-1) ~ 0.999: at the cap
        logits[-1, vocab // 2 :] = float("-inf")
    return (
        head.to(device),
        hidden.to(device),
        markov.to(device),
        logits.to(torch.bfloat16).to(device),
    )


def check_kernel_against_head(case, device: torch.device) -> None:
    """Also run on a GPU by tests/gpu/test_capacity_kernels_gpu.py."""
    head, hidden, markov, logits = head_and_inputs(case, device)
    for position in range(K):
        got = head(hidden[:, position], markov, logits, position)
        want = head(hidden[:, position], markov, logits, position, kernel=False)
        assert got.dtype == torch.float32 and got.shape == want.shape
        # At p(top-1) = 0.999, fp32 holds 1 - p to ~1e-4 of itself in either computation
        # (and a GPU's exp is approximate): log(1 - p) agrees to ~1e-4 per unit weight.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_matches_the_head(case):
    check_kernel_against_head(case, torch.device("cpu"))


@interpreted
def test_interpreted_kernel_with_no_rows_launches_nothing():
    head, hidden, markov, logits = head_and_inputs(CASES[0], torch.device("cpu"))
    assert head(hidden[:0, 0], markov[:0], logits[:0]).shape == (0,)
