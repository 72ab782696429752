import pytest
import torch

from vllm_dspark.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_demo_without_gpu_says_so_and_fails(capsys):
    assert main(["demo"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["vllm-dspark demo needs a CUDA GPU, and this machine has none."]
