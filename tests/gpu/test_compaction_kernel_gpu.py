"""On a GPU: the compaction kernel writes what the PyTorch compact layout says (the CPU
suite checks the same under Triton's interpreter)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_compaction_kernel import NUM_REQS, check_kernel_against_layout  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_kernel_matches_the_pytorch_layout_on_the_gpu(num_reqs):
    check_kernel_against_layout(num_reqs, torch.device("cuda"))
