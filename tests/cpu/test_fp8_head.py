"""Rowwise-FP8 draft head: quantisation, the PyTorch reference, and the Triton kernels on CPU.

The kernels run in Triton's interpreter, which must be switched on before ``triton`` is first
imported (its own ``tl.zeros`` and reductions are jit functions), so the ``test_interpreted_*``
tests run in a ``TRITON_INTERPRET=1`` pytest subprocess started by
``test_kernels_under_triton_interpreter`` and are skipped in the parent run. Three defects of the
Triton 3.6 interpreter are patched there: it multiplies bf16 operands of ``tl.dot`` as their
raw uint16 bits, its fp32 -> e4m3 cast drops the mantissa carry (127.5 -> 64) and does not
saturate, and its fp32 -> bf16 cast truncates. The patches substitute exact conversions, so
what is tested is the kernels' own indexing, masking, scaling and reductions. Tile sizes,
register use and speed are GPU-only.
"""

import numpy as np
import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.head.fp8_rowwise import (
    E4M3_MAX,
    E4M3_REL_ERR,
    E4M3_SUBNORMAL_ABS_ERR,
    Fp8RowwiseWeight,
    argmax_with_nan_policy,
    logit_error_bound,
    quantize_rows,
    reference_argmax,
    reference_logits,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    return (torch.randn(vocab, hidden, generator=gen(seed)) * 0.02).bfloat16()


def plant_winners(x: torch.Tensor, weight: torch.Tensor, rows, targets) -> torch.Tensor:
    """Point rows of x mostly along weight[target]: a clear, known argmax."""
    x = x.float().clone()
    for r, t in zip(rows, targets, strict=True):
        w = weight[t].float()
        x[r] = 0.2 * x[r] + 0.8 * w * (x[r].norm() / w.norm())
    return x.bfloat16()


def certified_rows(exact: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Rows whose exact top logit beats every other logit even after both move by the bound."""
    top = exact.argmax(dim=1, keepdim=True)
    lower_top = (exact - bound).gather(1, top)
    upper = (exact + bound).scatter(1, top, float("-inf"))
    return (lower_top > upper.amax(dim=1, keepdim=True)).squeeze(1)


# ---------------------------------------------------------------- quantisation


def test_scale_is_row_absmax_over_448_and_hits_448():
    w = random_head(64, 96, seed=1).float() * torch.logspace(-3, 2, 64)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, w.abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), E4M3_MAX))


def test_zero_rows_get_unit_scale_and_zero_codes():
    w = random_head(8, 32, seed=2)
    w[3] = 0
    head = Fp8RowwiseWeight.from_weight(w)
    assert head.scale[3] == 1.0
    assert not head.weight[3].float().any()
    assert torch.isfinite(head.dequantize()).all()
    assert not head.dequantize()[3].any()


def test_dequantisation_error_within_e4m3_bound_and_bound_is_tight():
    w = random_head(256, 128, seed=3).float()
    w[0, :8] = torch.tensor([1e-6, -3e-6, 2e-5, 0.0, 5e-7, 1e-4, -2e-4, 0.02])  # subnormal codes
    head = Fp8RowwiseWeight.from_weight(w)
    err = (head.dequantize() - w).abs()
    bound = E4M3_REL_ERR * w.abs() + E4M3_SUBNORMAL_ABS_ERR * head.scale[:, None]
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err / bound).max() > 0.9  # some element rounds by nearly half an ulp
    rel = (head.dequantize() - w).norm() / w.norm()
    assert 0.005 < rel < E4M3_REL_ERR


def test_round_trip_is_idempotent():
    head = Fp8RowwiseWeight.from_weight(random_head(128, 64, seed=4))
    again = Fp8RowwiseWeight.from_weight(head.dequantize())
    assert torch.equal(again.weight.view(torch.uint8), head.weight.view(torch.uint8))
    torch.testing.assert_close(again.scale, head.scale, rtol=1e-6, atol=0)


def test_non_finite_weights_are_refused():
    for bad in (float("nan"), float("inf")):
        w = random_head(4, 16, seed=5)
        w[2, 7] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            Fp8RowwiseWeight.from_weight(w)


def test_non_finite_activation_rows_get_nan_scale():
    x = torch.randn(4, 32, generator=gen(6))
    x[1, 3] = float("nan")
    x[2, 0] = float("-inf")
    _, scale = quantize_rows(x)
    assert torch.isnan(scale[1]) and torch.isnan(scale[2])
    assert torch.equal(scale[[0, 3]], x[[0, 3]].abs().amax(dim=1) / E4M3_MAX)


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("act_fp8", [True, False])
def test_reference_logits_within_documented_bound(act_fp8):
    w = random_head(2000, 512, seed=7)
    x = torch.randn(8, 512, generator=gen(8)).bfloat16()
    head = Fp8RowwiseWeight.from_weight(w)
    exact = x.double() @ w.double().T
    err = (reference_logits(x, head, act_fp8=act_fp8) - exact).abs()
    bound = logit_error_bound(x, w, act_fp8=act_fp8)
    assert (err <= bound * (1 + 1e-9) + 1e-12).all()
    rel = (err.norm() / exact.norm()).item()
    # Rounding errors mostly cancel: observed error is far below the worst case but not zero.
    assert 1e-3 < rel < (0.06 if act_fp8 else 0.04)
    assert (err / bound).max() < 0.5


@pytest.mark.parametrize("act_fp8", [True, False])
def test_reference_argmax_agrees_with_exact_where_gap_exceeds_bound(act_fp8):
    w = random_head(3000, 256, seed=9)
    planted_rows, targets = [0, 2, 5, 9, 11], [0, 2999, 1500, 64, 63]
    x = plant_winners(torch.randn(12, 256, generator=gen(10)), w, planted_rows, targets)
    head = Fp8RowwiseWeight.from_weight(w)
    exact = x.double() @ w.double().T
    certified = certified_rows(exact, logit_error_bound(x, w, act_fp8=act_fp8))
    assert certified[planted_rows].all()
    index, value = reference_argmax(x, head, act_fp8=act_fp8)
    assert torch.equal(index[certified], exact.argmax(dim=1)[certified])
    assert index[planted_rows].tolist() == targets
    assert value.dtype == torch.float32


def test_reference_vocab_limit_excludes_padding_rows():
    w = random_head(300, 64, seed=11)
    w[250:] = 1.0  # padding rows that would win every row
    x = torch.randn(6, 64, generator=gen(12)).abs().bfloat16()
    head = Fp8RowwiseWeight.from_weight(w)
    assert (reference_argmax(x, head)[0] >= 250).all()
    logits = reference_logits(x, head, vocab_limit=250)
    assert logits.shape == (6, 250)
    assert (reference_argmax(x, head, vocab_limit=250)[0] < 250).all()


def test_argmax_non_finite_policy_and_lowest_index_on_ties():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],
            [1.0, nan, 5.0, 2.0],
            [1.0, inf, 0.0, 0.0],
            [0.0, -inf, 0, 0],
            [0.0] * 4,
        ]
    )
    index, value = argmax_with_nan_policy(logits)
    assert index.tolist() == [1, -1, -1, -1, 0]
    assert value[0] == 3.0 and torch.isnan(value[1:4]).all() and value[4] == 0.0


def test_reference_markov_bias_is_added_before_the_argmax():
    w = random_head(500, 128, seed=13)
    w2 = random_head(500, 32, seed=14)
    x = torch.randn(5, 128, generator=gen(15)).bfloat16()
    e = torch.randn(5, 32, generator=gen(16)).bfloat16()
    head = Fp8RowwiseWeight.from_weight(w)
    base = reference_logits(x, head)
    for markov in (w2, Fp8RowwiseWeight.from_weight(w2)):
        dense = markov.dequantize(torch.float64) if isinstance(markov, Fp8RowwiseWeight) else w2
        with_bias = reference_logits(x, head, markov_embed=e, markov_weight=markov)
        torch.testing.assert_close(with_bias, base + e.double() @ dense.double().T)
    with pytest.raises(ValueError, match="go together"):
        reference_logits(x, head, markov_embed=e)


# ---------------------------------------------------------------- launcher (no kernel runs)


def test_default_table_covers_all_rows_with_one_token_tile_up_to_64():
    kernels = pytest.importorskip("vllm_dspark.head.fp8_head_kernel")
    for rows in range(1, 4097):
        cfg = kernels.default_config(rows)
        assert cfg.block_m >= min(rows, 64) and cfg.block_m >= 16
        candidates = kernels.candidate_configs(rows)
        assert candidates[0] == cfg and len(set(candidates)) == len(candidates)
        for c in candidates:
            assert c.block_v >= kernels.MIN_BLOCK_V and c.block_k >= 32
            assert c.block_m in (16, 32, 64, 128, 256)


def test_rescored_argmax_recovers_the_bf16_choice_and_its_tie_order():
    from vllm_dspark.head.rescore import rescored_argmax

    g = torch.Generator().manual_seed(5)
    rows, hidden, vocab, rank = 64, 32, 500, 4
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g)
    e = torch.randn(rows, rank, generator=g)
    w2 = torch.randn(vocab, rank, generator=g)
    exact = x @ w.T + e @ w2.T
    # Approximate logits that misorder close candidates but keep the winner in the top 4.
    approx = exact + 0.3 * torch.randn(rows, vocab, generator=g)
    assert (approx.argmax(-1) != exact.argmax(-1)).any()
    got = rescored_argmax(approx, x, w, e, w2)
    assert torch.equal(got, exact.argmax(-1))
    # A negative logit scale reverses the order the argmax reads.
    assert torch.equal(rescored_argmax(-approx, x, w, e, w2, scale=-1.0), (-exact).argmax(-1))
    # Exact ties go to the lowest index, as torch.argmax does, whatever the approximation.
    w[7], w[3] = w[11], w[11]
    tie_x = w[11:12] * 10
    approx = torch.zeros(1, vocab)
    approx[0, [11, 7, 3, 200]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert rescored_argmax(approx, tie_x, w).item() == 3


def test_large_row_counts_go_to_cublas_where_it_applies():
    kernels = pytest.importorskip("vllm_dspark.head.fp8_head_kernel")
    assert not kernels.default_config(kernels.CUBLAS_MIN_ROWS - 1).cublas
    assert kernels.default_config(kernels.CUBLAS_MIN_ROWS).cublas
    tiles = kernels.default_config(1792, cublas=False)
    assert not tiles.cublas and tiles.tma_ctas_per_sm == 1
    assert tiles in kernels.candidate_configs(1792)
    aligned = Fp8RowwiseWeight.from_weight(random_head(160, 64, seed=3))
    odd = Fp8RowwiseWeight.from_weight(random_head(100, 64, seed=4))
    assert kernels.cublas_compatible(aligned) and not kernels.cublas_compatible(odd)
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.fp8_head_argmax(x, odd, config=kernels.default_config(1792))


def test_launchers_validate_inputs_and_accept_zero_rows():
    kernels = pytest.importorskip("vllm_dspark.head.fp8_head_kernel")
    head = Fp8RowwiseWeight.from_weight(random_head(100, 64, seed=17))
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.fp8_head_argmax(x.float(), head)
    with pytest.raises(ValueError, match="vocab_limit"):
        kernels.fp8_head_argmax(x, head, vocab_limit=101)
    with pytest.raises(ValueError, match="does not match"):
        kernels.fp8_head_logits(torch.randn(3, 32).bfloat16(), head)
    e = torch.randn(3, 16).bfloat16()
    with pytest.raises(ValueError, match="with scales"):
        kernels.fp8_head_argmax(x, head, markov_embed=e, markov_weight=head.weight[:, :16])
    with pytest.raises(ValueError, match="go together"):
        kernels.fp8_head_argmax(x, head, markov_embed=e)
    index, value = kernels.fp8_head_argmax(x[:0], head)
    assert index.shape == (0,) and value.shape == (0,)
    cublas = next(c for c in kernels.candidate_configs(1792) if c.cublas)
    w2 = torch.randn(100, 16).bfloat16()
    with pytest.raises(ValueError, match="cuBLAS route"):
        kernels.fp8_head_argmax(x, head, markov_embed=e, markov_weight=w2, config=cublas)
    assert kernels.fp8_head_logits(x[:0], head, vocab_limit=90).shape == (0, 90)


# ---------------------------------------------------------------- kernels in the interpreter


def test_kernels_under_triton_interpreter():
    assert run_interpreted(__file__) >= 40


@pytest.fixture
def kernels(monkeypatch):
    import triton.language as tl
    from triton.runtime import interpreter

    from vllm_dspark.head import fp8_head_kernel

    def as_float32(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        if handle.dtype.scalar == tl.float8e4nv:
            return torch.from_numpy(handle.data).view(torch.float8_e4m3fn).float().numpy()
        return handle.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        product = np.matmul(as_float32(a), as_float32(b))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder = interpreter.InterpreterBuilder

    def rounding(original):
        """Casts to e4m3 and bf16 as the GPU does them: round to nearest even, keep NaN."""

        def cast(self, src, dst_type, *args):
            if dst_type.scalar == tl.float8e4nv:  # cvt.rn.satfinite also saturates
                values = torch.from_numpy(as_float32(src).copy()).clamp(-E4M3_MAX, E4M3_MAX)
                codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
                return interpreter.TensorHandle(codes, dst_type.scalar)
            if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
                values = torch.from_numpy(src.data.copy()).to(torch.bfloat16)
                return interpreter.TensorHandle(values.view(torch.uint16).numpy(), tl.bfloat16)
            return original(self, src, dst_type, *args)

        return cast

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "create_fp_to_fp", rounding(builder.create_fp_to_fp))
    monkeypatch.setattr(builder, "create_fp_trunc", rounding(builder.create_fp_trunc))
    return fp8_head_kernel


def small_configs(kernels):
    """Both kernels and operand paths; H = 192 is a multiple of 64 but not of 128, so some
    configs run a masked (pointer) or zero-filled (TMA) K tail. The persistent TMA programs
    (3 here: the interpreter reports one SM) each stride over several tiles."""
    cfg = kernels.HeadTileConfig
    return [
        cfg(64, 16, 64, 4, 2, act_fp8=True),
        cfg(128, 16, 128, 4, 2, act_fp8=False),
        cfg(64, 16, 128, 4, 2, act_fp8=True),
        cfg(64, 32, 64, 4, 2, act_fp8=False),
        cfg(64, 16, 128, 4, 2, act_fp8=True, tma_ctas_per_sm=3),
        cfg(128, 16, 64, 4, 2, act_fp8=False, tma_ctas_per_sm=3),
    ]


def markov_inputs(kind: str, rows: int, vocab: int):
    if kind == "none":
        return None, None
    e = torch.randn(rows, 40, generator=gen(20)).bfloat16()
    w2 = random_head(vocab, 40, seed=21)
    return e, (Fp8RowwiseWeight.from_weight(w2) if kind == "fp8" else w2)


@interpreted
def test_interpreted_quantize_activations_is_bit_identical(kernels):
    x = torch.randn(6, 200, generator=gen(22)) * torch.tensor([1, 1e-3, 1e4, 1, 1, 1])[:, None]
    x[3] = 0
    x[4, 17] = float("nan")
    x[5, 5] = float("inf")
    x = x.bfloat16()
    q, scale = kernels.quantize_activations(x)
    ref_q, ref_scale = quantize_rows(x)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q[:4].view(torch.uint8), ref_q[:4].view(torch.uint8))


@interpreted
@pytest.mark.parametrize("markov", ["none", "bf16", "fp8"])
@pytest.mark.parametrize("config_index", range(6))
def test_interpreted_logits_match_reference(kernels, config_index, markov):
    config = small_configs(kernels)[config_index]
    vocab, hidden, rows, limit = 300, 192, 21, 290
    head = Fp8RowwiseWeight.from_weight(random_head(vocab, hidden, seed=23))
    x = torch.randn(rows, hidden, generator=gen(24)).bfloat16()
    e, w2 = markov_inputs(markov, rows, vocab)
    ref = reference_logits(
        x, head, act_fp8=config.act_fp8, markov_embed=e, markov_weight=w2, vocab_limit=limit
    )
    out = torch.full((rows, vocab), float("nan"))
    got = kernels.fp8_head_logits(
        x, head, markov_embed=e, markov_weight=w2, vocab_limit=limit, out=out, config=config
    )
    assert got is out
    torch.testing.assert_close(out[:, :limit].double(), ref, rtol=1e-5, atol=1e-5)
    assert (out[:, limit:] == float("-inf")).all()
    bf16 = kernels.fp8_head_logits(
        x, head, markov_embed=e, markov_weight=w2, vocab_limit=limit, config=config
    )
    assert bf16.shape == (rows, limit) and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), ref, rtol=2**-8, atol=1e-5)


@interpreted
@pytest.mark.parametrize("markov", ["none", "bf16", "fp8"])
@pytest.mark.parametrize("config_index", range(6))
def test_interpreted_argmax_matches_reference(kernels, config_index, markov):
    config = small_configs(kernels)[config_index]
    vocab, hidden, rows, limit = 300, 192, 21, 290
    w = random_head(vocab, hidden, seed=25)
    w[limit:] = 0.5  # padding rows that would win every row if not masked
    planted_rows, targets = [0, 3, 16, 20], [0, limit - 1, 127, 128]
    x = plant_winners(torch.randn(rows, hidden, generator=gen(26)), w, planted_rows, targets)
    head = Fp8RowwiseWeight.from_weight(w)
    e, w2 = markov_inputs(markov, rows, vocab)
    kwargs = dict(markov_embed=e, markov_weight=w2, vocab_limit=limit)
    ref = reference_logits(x, head, act_fp8=config.act_fp8, **kwargs)
    ref_index, ref_value = argmax_with_nan_policy(ref)
    out_index = torch.full((rows,), -7, dtype=torch.int64)
    out_value = torch.full((rows,), float("nan"))
    index, value = kernels.fp8_head_argmax(
        x, head, out_index=out_index, out_value=out_value, config=config, **kwargs
    )
    assert index is out_index and value is out_value
    clear = certified_rows(ref, torch.full_like(ref, 1e-4))
    assert clear.sum() >= rows - 2 and clear[planted_rows].all()
    assert torch.equal(index[clear], ref_index[clear])
    assert index[planted_rows].tolist() == targets
    assert ((index >= 0) & (index < limit)).all()
    torch.testing.assert_close(value.double(), ref_value.double(), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("tma", [0, 3])
@pytest.mark.parametrize("act_fp8", [True, False])
def test_interpreted_ties_go_to_the_lowest_index(kernels, act_fp8, tma):
    vocab, hidden = 300, 64
    w = torch.randint(-1, 2, (vocab, hidden), generator=gen(27)).float()
    w[:, 0] = 1  # every row's absmax is 1: codes are +-448 or 0, dot products exact
    for low, high in ((5, 200), (70, 71), (130, 299)):  # across tiles, within a tile
        w[high] = w[low]
    x = w[[5, 70, 130]].bfloat16()
    head = Fp8RowwiseWeight.from_weight(w.bfloat16())
    config = kernels.HeadTileConfig(64, 16, 64, 4, 2, act_fp8=act_fp8, tma_ctas_per_sm=tma)
    index, _ = kernels.fp8_head_argmax(x, head, config=config)
    assert index.tolist() == [5, 70, 130]
    assert reference_argmax(x, head, act_fp8=act_fp8)[0].tolist() == [5, 70, 130]


@interpreted
@pytest.mark.parametrize("tma", [0, 3])
@pytest.mark.parametrize("act_fp8", [True, False])
def test_interpreted_non_finite_never_passes_as_a_token(kernels, act_fp8, tma):
    vocab, hidden, rows = 300, 192, 6
    head = Fp8RowwiseWeight.from_weight(random_head(vocab, hidden, seed=28))
    x = torch.randn(rows, hidden, generator=gen(29)).bfloat16()
    x[1, 100] = float("nan")
    x[4, 3] = float("inf")
    e, w2 = markov_inputs("bf16", rows, vocab)
    e[3, 7] = float("nan")
    config = kernels.HeadTileConfig(64, 16, 64, 4, 2, act_fp8=act_fp8, tma_ctas_per_sm=tma)
    index, value = kernels.fp8_head_argmax(x, head, markov_embed=e, markov_weight=w2, config=config)
    assert index[[1, 3, 4]].tolist() == [-1, -1, -1]
    assert torch.isnan(value[[1, 3, 4]]).all()
    ref_index, _ = reference_argmax(x, head, act_fp8=act_fp8, markov_embed=e, markov_weight=w2)
    assert torch.equal(index, ref_index)
    assert torch.isfinite(value[[0, 2, 5]]).all()
    logits = kernels.fp8_head_logits(x, head, config=config)
    assert torch.isnan(logits[1]).all() and torch.isfinite(logits[[0, 2, 3, 5]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_heads_refuse_a_model_that_is_not_bf16(dtype):
    from types import SimpleNamespace

    from vllm_dspark.config import DSparkOptionError, DSparkOptions
    from vllm_dspark.head.draft_heads import DraftHeads

    model = SimpleNamespace(
        logits_processor=SimpleNamespace(org_vocab_size=64, scale=1.0, soft_cap=None),
        lm_head=torch.nn.Linear(16, 64, bias=False).to(dtype),
    )
    with pytest.raises(DSparkOptionError, match="bfloat16"):
        DraftHeads(model, DSparkOptions(fp8_draft_head=True), max_rows=8)
    assert DraftHeads(model, DSparkOptions(), max_rows=8).lm_head is None
