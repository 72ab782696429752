"""On a GPU: the FP8 drafter layers' GEMM (``torch._scaled_mm`` with rowwise scales) computes
the product of the dequantised operands that the CPU path computes, at a drafter's shapes,
eager and under torch.compile (how vLLM runs the drafter).

"The same product" up to the GPU's own rounding, bounded per element by
- the bf16 output, rounded twice (the GEMM's output, then the bias add): 2^-8 of the value;
- Hopper's FP8 tensor cores, which keep about 14 mantissa bits while accumulating (cuBLAS
  promotes partial sums to fp32 only every few k-blocks): 2^-9 of the sum of the terms'
  magnitudes, ``|x| @ |W|^T``. At 2,048 tokens a few thousand of 12.6 M elements differ from
  the fp32 product by up to 1e-3 of that sum; a misapplied scale errs by the value itself.
"""

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
    out = run(x, q, scale, bias).cpu().float()
    reference = fp8_linear(x.cpu(), q.cpu(), scale.cpu(), bias.cpu()).float()
    assert out.shape == (tokens, 6144)

    x_q, x_scale = quantize_rows(x.cpu())
    magnitudes = (x_q.float() * x_scale[:, None]).abs() @ (
        q.cpu().float() * scale.cpu()[:, None]
    ).abs().t()
    bound = 2**-8 * reference.abs() + 2**-9 * magnitudes
    excess = (out - reference).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements beyond the bound"
