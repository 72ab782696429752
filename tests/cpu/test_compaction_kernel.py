"""The compaction kernel writes what the PyTorch compact layout says (Triton interpreter).

As in ``test_fp8_head.py``, the interpreter must be on before ``triton`` is first imported,
so the ``interpreted`` tests run in a ``TRITON_INTERPRET=1`` pytest subprocess started by
``test_kernel_under_triton_interpreter`` and are skipped in the parent run.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dspark.verify.compaction import compact_layout, compact_seq_lens

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="run by test_kernel_under_triton_interpreter in a subprocess"
)
K, MAX_NUM_REQS = 7, 24
NUM_REQS = [1, 2, 5, 16, 23, MAX_NUM_REQS]


def test_kernel_under_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter subprocess")
    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        command + ["-k", "interpreted"], env=env, cwd=repo, capture_output=True, text=True
    )
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) == 6 and " skipped" not in done.stdout, report


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
    """Also run on a GPU by tests/gpu/test_compaction_kernel_gpu.py."""
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
