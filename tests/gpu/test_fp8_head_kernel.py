"""On a GPU: the rowwise-FP8 draft-head kernels against the fp64 PyTorch reference.

Fresh random inputs (weights std 0.02, activations std 1) at real head shapes. The reference
uses the same quantised operands (``fp8_rowwise.reference_logits`` in fp64), so the kernel may
differ from it only by accumulation order and precision: Hopper's fp8 MMA keeps ~14 bits while
it accumulates (promoted to fp32 every <= 128 of K), bf16 MMAs accumulate
in fp32. ``ACC_TOL`` bounds that error relative to ``sum |x'||w'|`` with a wide margin over
those mechanisms; an argmax is asserted exactly where the reference's winner beats every other
logit by more than the tolerance on both sides (``certified_rows``).
"""

import functools

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_dspark.head import fp8_head_kernel as kernels  # noqa: E402
from vllm_dspark.head.fp8_rowwise import (  # noqa: E402
    Fp8RowwiseWeight,
    argmax_with_nan_policy,
    logit_error_bound,
    quantize_rows,
    reference_logits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ACC_TOL = 2.0**-9
QWEN3_8B, DEEPSEEK_V3 = (4096, 151936), (7168, 129280)


@functools.lru_cache(maxsize=2)
def make_head(hidden: int, vocab: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    return weight, Fp8RowwiseWeight.from_weight(weight)


def random_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, cols, device="cuda", generator=g).bfloat16()


def plant_winners(x, weight, rows, targets):
    x = x.float().clone()
    for r, t in zip(rows, targets, strict=True):
        w = weight[t].float()
        x[r] = 0.2 * x[r] + 0.8 * w * (x[r].norm() / w.norm())
    return x.bfloat16()


def magnitude(x, head, act_fp8, markov_embed=None, markov_weight=None, limit=None):
    """``sum |x'||w'|`` per logit (plus the Markov term): the scale of accumulation error."""
    if act_fp8:
        q, s = quantize_rows(x)
        xd = q.double() * s.double()[:, None]
    else:
        xd = x.double()
    mag = xd.abs() @ head.dequantize(torch.float64)[:limit].abs().T
    if markov_embed is not None:
        w2 = markov_weight
        w2 = w2.dequantize(torch.float64) if isinstance(w2, Fp8RowwiseWeight) else w2.double()
        mag += markov_embed.double().abs() @ w2[:limit].abs().T
    return mag


def certified_rows(ref, bound):
    top = ref.argmax(dim=1, keepdim=True)
    lower_top = (ref - bound).gather(1, top)
    upper = (ref + bound).scatter(1, top, float("-inf"))
    return (lower_top > upper.amax(dim=1, keepdim=True)).squeeze(1)


def planted_inputs(weight, rows: int, limit: int, seed: int):
    """Random rows, some pointed at a known winner (the last valid column, the first, a tile
    edge, mid-vocabulary) and, given padding and >= 5 rows, one at a padding row that must
    not win."""
    x = random_rows(rows, weight.shape[1], seed=seed)
    plan = {}
    for r, t in ((0, limit - 1), (rows - 1, 0), (rows // 2, 128), (1, limit // 2 + 1)):
        if r < rows and r not in plan:
            plan[r] = t
    planted, targets = list(plan), list(plan.values())
    if rows >= 5 and weight.shape[0] > limit + 5:
        planted.append(rows - 2)  # never one of the rows above for rows >= 5
        targets.append(limit + 5)
    return plant_winners(x, weight, planted, targets), plan


def check_argmax(
    x, head, config, *, plan=None, vocab_limit=None, markov_embed=None, markov_weight=None
):
    """Fused argmax against the reference; returns (index, certified rows)."""
    limit = head.vocab if vocab_limit is None else vocab_limit
    kw = dict(markov_embed=markov_embed, markov_weight=markov_weight, vocab_limit=vocab_limit)
    rows = x.shape[0]
    out_index = torch.full((rows,), -7, dtype=torch.int64, device="cuda")
    out_value = torch.full((rows,), float("nan"), device="cuda")
    index, value = kernels.fp8_head_argmax(
        x, head, out_index=out_index, out_value=out_value, config=config, **kw
    )
    ref = reference_logits(x, head, act_fp8=config.act_fp8, **kw)
    ref_index, ref_value = argmax_with_nan_policy(ref)
    bound = ACC_TOL * magnitude(x, head, config.act_fp8, markov_embed, markov_weight, limit)
    certified = certified_rows(ref, bound)
    assert ((index >= 0) & (index < limit)).all(), "unwritten row or masked column won"
    assert torch.equal(index[certified], ref_index[certified])
    value_bound = bound.amax(dim=1)
    if config.cublas:  # cuBLAS writes bf16 logits: the value is rounded to 8 mantissa bits
        value_bound = value_bound + ref_value.double().abs() * 2.0**-8
    assert ((value.double() - ref_value.double()).abs() <= value_bound).all()
    if plan:
        assert certified[list(plan)].all()
        assert index[list(plan)].tolist() == list(plan.values())
    if rows >= 64:
        assert certified.float().mean() >= 0.15  # the exact comparison covers many rows
    return index, certified


@pytest.mark.parametrize(
    "shape,rows",
    [(QWEN3_8B, r) for r in (1, 20, 37, 256, 1792)] + [(DEEPSEEK_V3, r) for r in (8, 64, 1792)],
)
def test_fused_argmax_matches_reference_at_real_shapes(shape, rows):
    hidden, vocab = shape
    weight, head = make_head(hidden, vocab)
    limit = vocab - 77  # stands in for the padding rows of ParallelLMHead
    x, plan = planted_inputs(weight, rows, limit, seed=rows)
    config = kernels.default_config(rows)
    index, _ = check_argmax(x, head, config, plan=plan, vocab_limit=limit)
    # Against the unquantised bf16 head, wherever the worst-case FP8 bound certifies a winner.
    exact = x.double() @ weight[:limit].double().T
    sure = certified_rows(exact, logit_error_bound(x, weight[:limit], act_fp8=config.act_fp8))
    assert sure[list(plan)].all()
    assert torch.equal(index[sure], exact.argmax(dim=1)[sure])


@pytest.mark.parametrize("rows", [8, 64])
def test_weight_only_path_matches_reference(rows):
    weight, head = make_head(*QWEN3_8B)
    config = next(c for c in kernels.candidate_configs(rows) if not c.act_fp8)
    x, plan = planted_inputs(weight, rows, head.vocab, seed=100 + rows)
    check_argmax(x, head, config, plan=plan)


@pytest.mark.parametrize("rows", [8, 20, 64, 256])
def test_every_benchmark_candidate_matches_reference(rows):
    """Whichever config the benchmark finds fastest can become the default."""
    weight, head = make_head(*QWEN3_8B)
    x, plan = planted_inputs(weight, rows, head.vocab - 77, seed=200 + rows)
    for config in kernels.candidate_configs(rows):
        check_argmax(x, head, config, plan=plan, vocab_limit=head.vocab - 77)


@pytest.mark.parametrize("markov", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [16, 256])
def test_markov_bias_fused_into_the_argmax(markov, rows):
    hidden, vocab = QWEN3_8B
    weight, head = make_head(hidden, vocab)
    w2 = random_rows(vocab, 256, seed=rows) * 0.02
    markov_weight = Fp8RowwiseWeight.from_weight(w2) if markov == "fp8" else w2
    e = random_rows(rows, 256, seed=rows + 1)
    x, plan = planted_inputs(weight, rows, vocab, seed=rows + 2)
    config = kernels.default_config(rows, cublas=False)  # the Markov bias is fused in tiles
    index, _ = check_argmax(x, head, config, plan=plan, markov_embed=e, markov_weight=markov_weight)
    without, _ = kernels.fp8_head_argmax(x, head, config=config)
    assert (index != without).any(), "the bias changed no argmax"


@pytest.mark.parametrize("hidden,vocab,rows", [(1000, 50257, 5), (1000, 50257, 300)])
def test_odd_shapes(hidden, vocab, rows):
    weight, head = make_head(hidden, vocab)
    x, plan = planted_inputs(weight, rows, 50000, seed=rows)
    # Neither dimension is a multiple of 16: no cuBLAS route, the tiles run at every size.
    assert not kernels.cublas_compatible(head)
    tiles = kernels.default_config(rows, cublas=False)
    expected, _ = check_argmax(x, head, tiles, plan=plan, vocab_limit=50000)
    index, _ = kernels.fp8_head_argmax(x, head, vocab_limit=50000)  # the launcher's own pick
    assert torch.equal(index, expected)
    out = torch.full((rows, vocab), float("nan"), device="cuda")
    kernels.fp8_head_logits(x, head, vocab_limit=50000, out=out)
    assert (out[:, 50000:] == float("-inf")).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 256])
def test_logits_relative_error(rows, out_dtype):
    weight, head = make_head(*QWEN3_8B)
    x = random_rows(rows, QWEN3_8B[0], seed=rows + 9)
    config = kernels.default_config(rows)
    out = torch.full((rows, head.vocab), float("nan"), dtype=out_dtype, device="cuda")
    kernels.fp8_head_logits(x, head, out=out, config=config)
    ref = reference_logits(x, head, act_fp8=config.act_fp8)
    err = out.double() - ref
    rel = (err.norm() / ref.norm()).item()
    assert rel < (1e-3 if out_dtype == torch.float32 else 5e-3), rel
    rounding = 2.0**-8 * ref.abs() if out_dtype == torch.bfloat16 else 0
    assert (err.abs() <= ACC_TOL * magnitude(x, head, config.act_fp8) + rounding).all()


@pytest.mark.parametrize("act_fp8", [True, False])
def test_non_finite_inputs_never_pass_as_tokens(act_fp8):
    hidden, vocab = 1024, 4099
    weight, head = make_head(hidden, vocab)
    x = random_rows(6, hidden, seed=11)
    x[1, 100] = float("nan")
    x[4, 3] = float("inf")
    e = random_rows(6, 64, seed=12)
    e[3, 7] = float("nan")
    w2 = random_rows(vocab, 64, seed=13) * 0.02
    config = next(c for c in kernels.candidate_configs(6) if c.act_fp8 == act_fp8)
    index, value = kernels.fp8_head_argmax(x, head, markov_embed=e, markov_weight=w2, config=config)
    assert index[[1, 3, 4]].tolist() == [-1, -1, -1]
    assert torch.isnan(value[[1, 3, 4]]).all()
    good = [0, 2, 5]
    assert ((index[good] >= 0) & torch.isfinite(value[good])).all()
    ref_index, _ = argmax_with_nan_policy(
        reference_logits(x, head, act_fp8=act_fp8, markov_embed=e, markov_weight=w2)
    )
    assert torch.equal(index[[1, 3, 4]], ref_index[[1, 3, 4]])


@pytest.mark.parametrize("rows", [7, 300])  # the pointer kernel, the persistent TMA kernel
def test_cuda_graph_replay_matches_eager(rows):
    hidden, vocab = QWEN3_8B
    weight, head = make_head(hidden, vocab)
    limit = vocab - 64
    x = random_rows(rows, hidden, seed=21)
    e = random_rows(rows, 256, seed=22)
    w2 = random_rows(vocab, 256, seed=23) * 0.02
    workspace = kernels.HeadWorkspace.allocate(rows, head)
    index = torch.empty(rows, dtype=torch.int64, device="cuda")
    value = torch.empty(rows, device="cuda")
    logits = torch.empty(rows, limit, device="cuda")

    def step():
        kernels.fp8_head_argmax(
            x,
            head,
            markov_embed=e,
            markov_weight=w2,
            vocab_limit=limit,
            out_index=index,
            out_value=value,
            workspace=workspace,
        )
        kernels.fp8_head_logits(x, head, vocab_limit=limit, out=logits, workspace=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (31, 32):
        x.copy_(random_rows(rows, hidden, seed=seed))
        e.copy_(random_rows(rows, 256, seed=seed + 100))
        index.fill_(-7)
        logits.fill_(float("nan"))
        graph.replay()
        want_index, want_value = kernels.fp8_head_argmax(
            x, head, markov_embed=e, markov_weight=w2, vocab_limit=limit
        )
        want_logits = kernels.fp8_head_logits(x, head, vocab_limit=limit, out_dtype=torch.float32)
        assert torch.equal(index, want_index) and torch.equal(value, want_value)
        assert torch.equal(logits, want_logits)
