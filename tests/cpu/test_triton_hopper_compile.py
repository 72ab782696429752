"""Every Triton kernel of the plugin compiles for Hopper (sm_90), here, without a GPU.

Triton's interpreter, which the CPU suite runs the kernels under, accepts code the
compiler rejects: a kernel that read a plain module global passed every interpreted test
and then failed to compile on the H200 in every engine with capacity control. Each case
calls the plugin's own launcher on CPU tensors; the launch is intercepted and, instead of
running, the kernel is compiled down to a cubin for sm_90 with the arguments it was given.
"""

import inspect

import pytest
import torch
from triton_interpreter import INTERPRETED

triton = pytest.importorskip("triton")
if INTERPRETED:  # kernels launched under the interpreter never reach the compiler
    pytest.skip("Triton's interpreter is on", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@pytest.fixture
def compiled(monkeypatch):
    """Names of the kernels the launchers tried to run, each compiled for sm_90."""
    names = []

    def compile_instead(self, *args, grid, warmup, **kwargs):
        options = {key: kwargs.pop(key) for key in LAUNCH_OPTIONS if key in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs = {}, {}
        for param in self.params:
            value = bound.arguments[param.name]
            if param.is_constexpr or value is None:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = mangle_type(value)
        kernel = triton.compile(
            ASTSource(self, signature, constexprs), target=HOPPER, options=options
        )
        assert kernel.asm["cubin"]
        names.append(self.fn.__name__)

    monkeypatch.setattr(JITFunction, "run", compile_instead)
    return names


@pytest.mark.parametrize("with_sps", [True, False])
def test_proposal_kernel(compiled, with_sps):
    from vllm_dspark.capacity.proposal_kernel import proposal_stats

    survival = torch.rand(5, 7)
    table = torch.rand(256 * 8 + 1) if with_sps else None
    proposal_stats(survival, table, 1e-3, 1e-6, 2e-4, 0.5, max_num_reqs=256)
    assert compiled == ["_proposal_stats_kernel"]


def test_compaction_kernel(compiled):
    from vllm_dspark.verify.compaction_kernel import compact_on_device

    num_reqs, num_drafts = 4, 7
    uniform = num_reqs * (1 + num_drafts)
    compact_on_device(
        capacity=torch.tensor([0, 3, 7, 1], dtype=torch.int32),
        num_drafts=num_drafts,
        num_tokens=num_reqs + 11,
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        input_ids=torch.zeros(uniform, dtype=torch.int32),
        positions=torch.zeros(uniform, dtype=torch.int64),
        query_start_loc=torch.zeros(257, dtype=torch.int32),
        seq_lens=torch.full((num_reqs,), 40, dtype=torch.int32),
        max_num_reqs=256,
    )
    assert compiled == ["_compact_kernel"]


@pytest.mark.parametrize("rows", [1, 48])
def test_fp8_head_kernels(compiled, rows):
    from vllm_dspark.head import fp8_head_kernel as kernels
    from vllm_dspark.head.fp8_rowwise import Fp8RowwiseWeight

    hidden, vocab = 256, 1024
    head = Fp8RowwiseWeight.from_weight(torch.randn(vocab, hidden, dtype=torch.bfloat16))
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    config = kernels.default_config(rows, cublas=False)
    kernels.fp8_head_argmax(x, head, config=config)
    assert {"_quantize_rows_kernel", "_argmax_finalize_kernel"} <= set(compiled)
    assert {"_fp8_head_kernel", "_fp8_head_tma_kernel"} & set(compiled)


@pytest.mark.parametrize("statistics", [(True, True), (False, False)])
def test_confidence_kernel(compiled, statistics):
    from vllm_dspark.capacity.confidence_kernel import confidence_logit

    hidden, rank = 64, 16
    weight = torch.randn(hidden + rank + sum(statistics))
    rows = torch.randn(3, 7, hidden, dtype=torch.bfloat16)
    logits = torch.randn(3, 500, dtype=torch.bfloat16)
    confidence_logit(
        rows[:, 2], torch.randn(3, rank), logits, weight, torch.zeros(()), *statistics, -1e-3
    )
    assert compiled == ["_confidence_logit_kernel"]
