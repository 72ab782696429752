"""On a GPU: the FP8 drafter layers' GEMM (``torch._scaled_mm`` with rowwise scales) computes
the product of the dequantised operands that the CPU path computes, at a drafter's shapes,
eager and under torch.compile (how vLLM runs the drafter)."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm_dspark.draft_fp8 import fp8_linear  # noqa: E402
from vllm_dspark.head.fp8_rowwise import quantize_rows  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("tokens", [1, 37, 2048])
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_drafter_gemm_matches_the_dequantised_product(tokens, compiled):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(6144, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(6144, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_rows(weight)
    run = torch.compile(fp8_linear, dynamic=True) if compiled else fp8_linear
    out = run(x, q, scale, bias)
    reference = fp8_linear(x.cpu(), q.cpu(), scale.cpu(), bias.cpu())
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 6144)
    torch.testing.assert_close(out.cpu().float(), reference.float(), rtol=2e-2, atol=2e-2)
