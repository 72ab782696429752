"""Triton kernels for the rowwise-FP8 draft LM head: logits, and a fused greedy argmax.

The head multiplies ``x [M, H]`` (bf16, M the draft rows) by an e4m3 ``W [V, H]`` with fp32
row scales (:class:`Fp8RowwiseWeight`). With few rows that is a stream over W, with many an
FP8 GEMM. Each program computes a ``[BLOCK_V, BLOCK_M]`` tile with the weight as the MMA's A
operand ("swap AB", so a handful of tokens fill the narrow side), the work split over the
vocabulary. ``_fp8_head_kernel`` pipelines cp.async loads, one program per tile;
``_fp8_head_tma_kernel`` runs persistent programs with TMA loads for GEMM-sized tiles. The
operands are e4m3 x e4m3 (activations quantised per token) or W8A16 (weights upcast in
registers), chosen by :class:`HeadTileConfig`; :func:`default_config` picks per row count,
with cuBLAS's rowwise FP8 GEMM above 64 rows where it applies. Epilogues write logits
(columns past ``vocab_limit`` as -inf) or per-tile (max, lowest index) partials reduced by a
second kernel, with an optional low-rank Markov bias added in the same program; a row with a
non-finite logit gets index -1. No host sync: everything is CUDA-graph capturable. Design
notes: ``docs/design/module-notes.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm_dspark.head.fp8_rowwise import E4M3_MAX, Fp8RowwiseWeight

MIN_BLOCK_V = 64  # smallest vocab tile of any config: sizes the workspace's partial buffers
_QUANT_BLOCK_H = 1024
_E4M3_MAX = tl.constexpr(E4M3_MAX)


@dataclass(frozen=True)
class HeadTileConfig:
    block_v: int  # vocab rows per program (MMA M side, >= 64)
    block_m: int  # token rows per program (MMA N side, >= 16)
    block_k: int  # hidden-dimension step
    num_warps: int
    num_stages: int
    act_fp8: bool  # True: e4m3 x e4m3 dot; False: weight upcast to bf16 (W8A16)
    tma_ctas_per_sm: int = 0  # > 0: persistent TMA kernel with this many programs per SM
    # True: the product runs in cuBLAS (torch._scaled_mm, rowwise scales, bf16 out) and a
    # torch argmax follows; the tile fields are unused. No Markov fusion on this route.
    cublas: bool = False


# (max rows, config). Rows <= 64: one token tile, a weight stream through cp.async, several
# programs per SM. Above: an FP8 GEMM; persistent TMA programs overlap each tile's epilogue
# with the next tile's loads, and a 128x128 fp32 tile plus its promotion copy fits 8 warps.
_DEFAULT_TABLE: tuple[tuple[int, HeadTileConfig], ...] = (
    (16, HeadTileConfig(128, 16, 128, 4, 4, act_fp8=True)),
    (32, HeadTileConfig(128, 32, 128, 4, 4, act_fp8=True)),
    (64, HeadTileConfig(128, 64, 128, 4, 4, act_fp8=True)),
    (1 << 62, HeadTileConfig(128, 128, 128, 8, 3, act_fp8=True, tma_ctas_per_sm=1)),
)
# Above 64 rows the head is a compute-bound GEMM, where cuBLAS's FP8 kernels beat our tiles
# (benchmarks/results/fp8_head.json): they run the product and a torch argmax reads the bf16
# logits back.
CUBLAS_MIN_ROWS = 65
_CUBLAS = HeadTileConfig(128, 128, 128, 8, 3, act_fp8=True, cublas=True)


def default_config(rows: int, *, cublas: bool = True) -> HeadTileConfig:
    """The launcher's pick for ``rows`` token rows (a fixed table: graph-safe, no tuning).

    ``cublas=False`` where that route cannot run: a fused Markov bias, or a head whose
    hidden or vocabulary size is not a multiple of 16 (see :func:`cublas_compatible`).
    """
    if cublas and rows >= CUBLAS_MIN_ROWS:
        return _CUBLAS
    return next(cfg for max_rows, cfg in _DEFAULT_TABLE if rows <= max_rows)


def cublas_compatible(head: Fp8RowwiseWeight) -> bool:
    """cuBLAS's FP8 GEMM needs both matrix dimensions of the weight in multiples of 16."""
    return head.hidden % 16 == 0 and head.vocab % 16 == 0


def candidate_configs(rows: int) -> list[HeadTileConfig]:
    """The default first, then the alternatives the benchmark times for this row count."""
    base = default_config(rows)
    cfg = HeadTileConfig
    if rows <= 64:
        m = base.block_m
        # Persistent programs per SM: as many as 228 KB of shared memory holds (sm_90 builds
        # of these tiles use 74/83/100 KB for FP8 and 66/83/117 KB for W8A16 at m = 16/32/64).
        fp8_ctas, w8a16_ctas = {16: (3, 3), 32: (2, 2), 64: (2, 1)}[m]
        extra = [
            cfg(128, m, 128, 4, 4, act_fp8=False),
            cfg(64, m, 128, 4, 6, act_fp8=True),
            cfg(128, m, 256, 4, 3, act_fp8=True),
            cfg(128, m, 128, 4, 4, act_fp8=True, tma_ctas_per_sm=fp8_ctas),
            cfg(128, m, 128, 4, 4, act_fp8=False, tma_ctas_per_sm=w8a16_ctas),
        ]
    else:
        extra = [
            default_config(rows, cublas=False),
            cfg(128, 128, 128, 8, 3, act_fp8=True),
        ]
    return [base] + [c for c in extra if c != base]


@dataclass(frozen=True)
class HeadWorkspace:
    """Scratch of the launchers, preallocate it once per maximum row count for CUDA graphs."""

    x_q: torch.Tensor  # float8_e4m3fn [rows, H]: quantised activations (FP8 path)
    x_scale: torch.Tensor  # float32 [rows]
    part_value: torch.Tensor  # float32 [rows * max_tiles]: per-tile row maxima
    part_index: torch.Tensor  # int32 [rows * max_tiles]: their vocabulary indices

    @classmethod
    def allocate(cls, rows: int, head: Fp8RowwiseWeight) -> HeadWorkspace:
        device = head.weight.device
        parts = rows * triton.cdiv(head.vocab, MIN_BLOCK_V)
        return cls(
            x_q=torch.empty(rows, head.hidden, dtype=torch.float8_e4m3fn, device=device),
            x_scale=torch.empty(rows, dtype=torch.float32, device=device),
            part_value=torch.empty(parts, dtype=torch.float32, device=device),
            part_index=torch.empty(parts, dtype=torch.int32, device=device),
        )

    @property
    def rows(self) -> int:
        return self.x_scale.shape[0]


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, H, stride_x, stride_q, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    bad = tl.zeros([BLOCK_H], dtype=tl.int32)
    for h in range(0, H, BLOCK_H):
        v = tl.load(x_ptr + row * stride_x + h + offs, mask=h + offs < H, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        bad = tl.maximum(bad, ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32))
    row_max = tl.max(amax, axis=0)
    # Same IEEE divisions as fp8_rowwise.quantize_rows, so both round identically.
    scale = tl.where(row_max > 0, tl.math.div_rn(row_max, _E4M3_MAX), 1.0)
    scale = tl.where(tl.max(bad, axis=0) > 0, float("nan"), scale)
    for h in range(0, H, BLOCK_H):
        mask = h + offs < H
        v = tl.load(x_ptr + row * stride_x + h + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.math.div_rn(v, scale).to(tl.float8e4nv)
        tl.store(q_ptr + row * stride_q + h + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _markov_bias(
    e_ptr,
    w2_ptr,
    w2_scale_ptr,
    rows_m,
    rows_v,
    R,
    stride_e,
    stride_w2,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MARKOV_FP8: tl.constexpr,
):
    offs_r = tl.arange(0, BLOCK_R)
    e_ptrs = e_ptr + rows_m[:, None].to(tl.int64) * stride_e + offs_r[None, :]
    w2_ptrs = w2_ptr + rows_v[:, None].to(tl.int64) * stride_w2 + offs_r[None, :]
    bias = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.float32)
    for r in range(0, R, BLOCK_R):
        r_mask = (r + offs_r < R)[None, :]
        e = tl.load(e_ptrs, mask=r_mask, other=0.0)
        w2 = tl.load(w2_ptrs, mask=r_mask, other=0.0).to(tl.bfloat16)
        bias = tl.dot(w2, tl.trans(e), bias)
        e_ptrs += BLOCK_R
        w2_ptrs += BLOCK_R
    if MARKOV_FP8:
        bias = bias * tl.load(w2_scale_ptr + rows_v)[:, None]
    return bias


@triton.jit
def _tile_epilogue(
    acc,  # [BLOCK_V, BLOCK_M] fp32: sum over H of the (quantised) operands
    pid_v,
    pid_m,
    x_scale_ptr,
    w_scale_ptr,
    e_ptr,
    w2_ptr,
    w2_scale_ptr,
    out_ptr,
    part_value_ptr,
    part_index_ptr,
    M,
    V,
    R,
    vocab_limit,
    n_out,
    stride_e,
    stride_w2,
    stride_out,
    stride_part,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACT_FP8: tl.constexpr,
    HAS_MARKOV: tl.constexpr,
    MARKOV_FP8: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
):
    """Scales, Markov bias, then either the logits store or the per-tile argmax partial."""
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_v = tl.minimum(offs_v, V - 1)
    rows_m = tl.minimum(offs_m, M - 1)
    logits = acc * tl.load(w_scale_ptr + rows_v)[:, None]
    if ACT_FP8:
        logits = logits * tl.load(x_scale_ptr + rows_m)[None, :]
    if HAS_MARKOV:
        logits += _markov_bias(
            e_ptr,
            w2_ptr,
            w2_scale_ptr,
            rows_m,
            rows_v,
            R,
            stride_e,
            stride_w2,
            BLOCK_V,
            BLOCK_M,
            BLOCK_R,
            MARKOV_FP8,
        )
    valid = (offs_v < vocab_limit)[:, None]
    if WRITE_LOGITS:
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_out + offs_v[:, None]
        mask = (offs_m < M)[None, :] & (offs_v < n_out)[:, None]
        logits = tl.where(valid, logits, float("-inf"))
        tl.store(out_ptrs, logits.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Flag non-finite logits explicitly: max/argmax reductions skip or mis-order NaN.
        bad = ((logits != logits) | (tl.abs(logits) == float("inf"))) & valid
        tile_bad = tl.max(bad.to(tl.int32), axis=0)
        best, arg = tl.max(
            tl.where(valid & ~bad, logits, float("-inf")),
            axis=0,
            return_indices=True,
            return_indices_tie_break_left=True,
        )
        best = tl.where(tile_bad > 0, float("nan"), best)
        part = offs_m.to(tl.int64) * stride_part + pid_v
        row_ok = offs_m < M
        tl.store(part_value_ptr + part, best, mask=row_ok)
        tl.store(part_index_ptr + part, pid_v * BLOCK_V + arg, mask=row_ok)


# Sizes that vary per call or per head stay unspecialised (one binary serves every row count
# and vocabulary); H, R, n_out and the row strides are specialised: their divisibility lets
# loads and stores vectorise (an unaligned R alone stops the Markov loop from pipelining).
_RUNTIME_SIZES = ["M", "V", "vocab_limit", "num_m_tiles", "stride_part"]


@triton.jit(do_not_specialize=_RUNTIME_SIZES)
def _fp8_head_kernel(
    x_ptr,  # [M, H]: e4m3 (ACT_FP8) or bf16
    x_scale_ptr,  # [M] fp32 (ACT_FP8 only)
    w_ptr,  # [V, H] e4m3
    w_scale_ptr,  # [V] fp32
    e_ptr,  # [M, R] bf16 (HAS_MARKOV only)
    w2_ptr,  # [V, R] bf16 or e4m3 (HAS_MARKOV only)
    w2_scale_ptr,  # [V] fp32 (MARKOV_FP8 only)
    out_ptr,  # [M, n_out] logits (WRITE_LOGITS only)
    part_value_ptr,  # [M, num_v_tiles] fp32 (argmax only)
    part_index_ptr,  # [M, num_v_tiles] int32 (argmax only)
    M,
    H,
    V,
    R,
    vocab_limit,
    n_out,
    num_m_tiles,
    stride_x,
    stride_w,
    stride_e,
    stride_w2,
    stride_out,
    stride_part,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACT_FP8: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # K elements the fp8 MMA sums before fp32; None: all
    EVEN_K: tl.constexpr,
    HAS_MARKOV: tl.constexpr,
    MARKOV_FP8: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
):
    """One program per (vocab tile, token tile), cp.async-pipelined pointer loads."""
    # Token tiles of one vocab tile are consecutive programs: their weight reads share L2.
    pid = tl.program_id(0)
    pid_m = pid % num_m_tiles
    pid_v = pid // num_m_tiles
    # Clamped indices let the hot loop load without masks; the epilogue masks instead.
    rows_v = tl.minimum(pid_v * BLOCK_V + tl.arange(0, BLOCK_V), V - 1)
    rows_m = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), M - 1)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_v[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    x_ptrs = x_ptr + rows_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]

    acc = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xk = tl.load(x_ptrs)
        else:
            k_mask = (k + offs_k < H)[None, :]
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            xk = tl.load(x_ptrs, mask=k_mask, other=0.0)
        if ACT_FP8:
            acc = tl.dot(w, tl.trans(xk), acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        else:
            acc = tl.dot(w.to(tl.bfloat16), tl.trans(xk), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    _tile_epilogue(
        acc,
        pid_v,
        pid_m,
        x_scale_ptr,
        w_scale_ptr,
        e_ptr,
        w2_ptr,
        w2_scale_ptr,
        out_ptr,
        part_value_ptr,
        part_index_ptr,
        M,
        V,
        R,
        vocab_limit,
        n_out,
        stride_e,
        stride_w2,
        stride_out,
        stride_part,
        BLOCK_V,
        BLOCK_M,
        BLOCK_R,
        ACT_FP8,
        HAS_MARKOV,
        MARKOV_FP8,
        WRITE_LOGITS,
    )


@triton.jit(do_not_specialize=_RUNTIME_SIZES + ["num_tiles", "num_programs"])
def _fp8_head_tma_kernel(
    x_desc,  # TensorDescriptor of [M, H], block [BLOCK_M, BLOCK_K]
    x_scale_ptr,
    w_desc,  # TensorDescriptor of [V, H], block [BLOCK_V, BLOCK_K]
    w_scale_ptr,
    e_ptr,
    w2_ptr,
    w2_scale_ptr,
    out_ptr,
    part_value_ptr,
    part_index_ptr,
    M,
    H,
    V,
    R,
    vocab_limit,
    n_out,
    num_m_tiles,
    num_tiles,
    num_programs,
    stride_e,
    stride_w2,
    stride_out,
    stride_part,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACT_FP8: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,
    HAS_MARKOV: tl.constexpr,
    MARKOV_FP8: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
):
    """Persistent programs striding over the tiles; TMA loads (out-of-range rows read zeros).

    The flattened tile x K loop lets the pipeliner overlap one tile's epilogue with the
    next tile's loads; consecutive tile ids share a vocab tile, so concurrent programs
    share its L2 lines.
    """
    k_steps = tl.cdiv(H, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
        pid_m = tile % num_m_tiles
        pid_v = tile // num_m_tiles
        acc = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.float32)
        for k in range(k_steps):
            w = w_desc.load([pid_v * BLOCK_V, k * BLOCK_K])
            xk = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            if ACT_FP8:
                acc = tl.dot(w, xk.T, acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
            else:
                acc = tl.dot(w.to(tl.bfloat16), xk.T, acc)
        _tile_epilogue(
            acc,
            pid_v,
            pid_m,
            x_scale_ptr,
            w_scale_ptr,
            e_ptr,
            w2_ptr,
            w2_scale_ptr,
            out_ptr,
            part_value_ptr,
            part_index_ptr,
            M,
            V,
            R,
            vocab_limit,
            n_out,
            stride_e,
            stride_w2,
            stride_out,
            stride_part,
            BLOCK_V,
            BLOCK_M,
            BLOCK_R,
            ACT_FP8,
            HAS_MARKOV,
            MARKOV_FP8,
            WRITE_LOGITS,
        )


@triton.jit(do_not_specialize=["num_tiles", "stride_part"])
def _argmax_finalize_kernel(
    part_value_ptr,
    part_index_ptr,
    out_index_ptr,
    out_value_ptr,
    num_tiles,
    stride_part,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    vals = tl.load(
        part_value_ptr + row * stride_part + offs, mask=offs < num_tiles, other=float("-inf")
    )
    is_nan = vals != vals
    # Partials are in vocab order and each holds its tile's lowest maximal index, so the
    # leftmost maximal partial holds the row's lowest maximal index.
    best, pos = tl.max(
        tl.where(is_nan, float("-inf"), vals),
        axis=0,
        return_indices=True,
        return_indices_tie_break_left=True,
    )
    index = tl.load(part_index_ptr + row * stride_part + pos).to(tl.int64)
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    tl.store(out_index_ptr + row, tl.where(any_nan, -1, index))
    tl.store(out_value_ptr + row, tl.where(any_nan, float("nan"), best))


def quantize_activations(
    x: torch.Tensor,
    *,
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantisation on the GPU, bit-identical to ``fp8_rowwise.quantize_rows``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D with a contiguous last dimension")
    rows, hidden = x.shape
    if out_q is None:
        out_q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    if out_scale is None:
        out_scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows > 0:
        _quantize_rows_kernel[(rows,)](
            x, out_q, out_scale, hidden, x.stride(0), out_q.stride(0), BLOCK_H=_QUANT_BLOCK_H
        )
    return out_q, out_scale


def _check_inputs(x, head, markov_embed, markov_weight, vocab_limit) -> int:
    if not isinstance(head, Fp8RowwiseWeight):
        raise TypeError("head must be an Fp8RowwiseWeight")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError("x must be a 2-D bfloat16 tensor with a contiguous last dimension")
    if x.shape[1] != head.hidden or x.device != head.weight.device:
        raise ValueError(f"x {tuple(x.shape)} does not match the head {tuple(head.weight.shape)}")
    if (markov_embed is None) != (markov_weight is None):
        raise ValueError("markov_embed and markov_weight go together")
    if markov_embed is not None:
        fp8 = isinstance(markov_weight, Fp8RowwiseWeight)
        w2 = markov_weight.weight if fp8 else markov_weight
        if not (fp8 or w2.dtype == torch.bfloat16) or w2.stride(1) != 1:
            raise ValueError("markov_weight must be bf16 or an Fp8RowwiseWeight (with scales)")
        if markov_embed.dtype != torch.bfloat16 or markov_embed.stride(1) != 1:
            raise ValueError("markov_embed must be bfloat16 with a contiguous last dimension")
        if w2.shape[0] != head.vocab or markov_embed.shape != (x.shape[0], w2.shape[1]):
            raise ValueError("markov shapes must be embed [rows, r] and weight [vocab, r]")
    limit = head.vocab if vocab_limit is None else int(vocab_limit)
    if not 1 <= limit <= head.vocab:
        raise ValueError(f"vocab_limit must be in [1, {head.vocab}], got {limit}")
    return limit


def _pick_config(
    config: HeadTileConfig | None, rows: int, head: Fp8RowwiseWeight, has_markov: bool
) -> HeadTileConfig:
    """The given config, checked, or the default for this call."""
    if config is None:
        return default_config(rows, cublas=not has_markov and cublas_compatible(head))
    if config.cublas:
        if has_markov or not config.act_fp8 or not cublas_compatible(head):
            raise ValueError(
                "the cuBLAS route is FP8 x FP8 without a Markov bias, for a head whose "
                "dimensions are multiples of 16"
            )
        return config
    if config.block_v < MIN_BLOCK_V or config.block_m < 16 or config.block_k < 32:
        raise ValueError(f"tile too small for tl.dot / the workspace: {config}")
    return config


def _launch_tiles(
    x,
    head,
    markov_embed,
    markov_weight,
    vocab_limit,
    n_cols,
    config,
    workspace,
    *,
    out=None,
    part_value=None,
    part_index=None,
):
    """Quantise x if needed and run the tile kernel over ``n_cols`` vocabulary columns."""
    rows = x.shape[0]
    if config.act_fp8:
        x_in, x_scale = quantize_activations(
            x, out_q=workspace.x_q[:rows], out_scale=workspace.x_scale[:rows]
        )
    else:
        x_in, x_scale = x, None
    has_markov = markov_embed is not None
    markov_fp8 = isinstance(markov_weight, Fp8RowwiseWeight)
    w2 = markov_weight.weight if markov_fp8 else markov_weight
    rank = markov_embed.shape[1] if has_markov else 0
    num_m_tiles = triton.cdiv(rows, config.block_m)
    num_tiles = triton.cdiv(n_cols, config.block_v) * num_m_tiles
    shared = dict(
        x_scale_ptr=x_scale,
        w_scale_ptr=head.scale,
        e_ptr=markov_embed,
        w2_ptr=w2,
        w2_scale_ptr=markov_weight.scale if markov_fp8 else None,
        out_ptr=out,
        part_value_ptr=part_value,
        part_index_ptr=part_index,
        M=rows,
        H=head.hidden,
        V=head.vocab,
        R=rank,
        vocab_limit=vocab_limit,
        n_out=out.shape[1] if out is not None else 0,
        num_m_tiles=num_m_tiles,
        stride_e=markov_embed.stride(0) if has_markov else 0,
        stride_w2=w2.stride(0) if has_markov else 0,
        stride_out=out.stride(0) if out is not None else 0,
        stride_part=part_value.stride(0) if part_value is not None else 0,
        BLOCK_V=config.block_v,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_R=max(16, min(64, triton.next_power_of_2(max(rank, 1)))),
        ACT_FP8=config.act_fp8,
        MAX_IMPRECISE_ACC=min(config.block_k, 128),
        HAS_MARKOV=has_markov,
        MARKOV_FP8=markov_fp8,
        WRITE_LOGITS=out is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.tma_ctas_per_sm and _tma_compatible(x_in, head):
        num_programs = min(num_tiles, config.tma_ctas_per_sm * _sm_count(x.device))
        _fp8_head_tma_kernel[(num_programs,)](
            x_desc=TensorDescriptor.from_tensor(x_in, [config.block_m, config.block_k]),
            w_desc=TensorDescriptor.from_tensor(head.weight, [config.block_v, config.block_k]),
            num_tiles=num_tiles,
            num_programs=num_programs,
            **shared,
        )
    else:
        _fp8_head_kernel[(num_tiles,)](
            x_ptr=x_in,
            w_ptr=head.weight,
            stride_x=x_in.stride(0),
            stride_w=head.weight.stride(0),
            EVEN_K=head.hidden % config.block_k == 0,
            **shared,
        )


def _cublas_logits(x, head, workspace, out_dtype=torch.bfloat16) -> torch.Tensor:
    """All ``[rows, vocab]`` logits through cuBLAS's rowwise-scaled FP8 GEMM."""
    rows = x.shape[0]
    x_q, x_scale = quantize_activations(
        x, out_q=workspace.x_q[:rows], out_scale=workspace.x_scale[:rows]
    )
    return torch._scaled_mm(
        x_q,
        head.weight.t(),
        scale_a=x_scale[:, None],
        scale_b=head.scale[None, :],
        out_dtype=out_dtype,
    )


def _tma_compatible(x_in: torch.Tensor, head: Fp8RowwiseWeight) -> bool:
    """TMA needs 16-byte aligned bases and row strides; otherwise the pointer kernel runs."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in (x_in, head.weight)
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _workspace_for(workspace, rows, head) -> HeadWorkspace:
    if workspace is None:
        return HeadWorkspace.allocate(rows, head)
    if workspace.rows < rows or workspace.x_q.shape[1] != head.hidden:
        raise ValueError(f"workspace for {workspace.rows} rows cannot serve {rows} rows")
    if workspace.part_value.numel() < rows * triton.cdiv(head.vocab, MIN_BLOCK_V):
        raise ValueError("workspace was allocated for a smaller vocabulary")
    return workspace


def fp8_head_logits(
    x: torch.Tensor,
    head: Fp8RowwiseWeight,
    *,
    markov_embed: torch.Tensor | None = None,
    markov_weight: torch.Tensor | Fp8RowwiseWeight | None = None,
    vocab_limit: int | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    workspace: HeadWorkspace | None = None,
    config: HeadTileConfig | None = None,
) -> torch.Tensor:
    """Draft logits ``x @ W.T (+ markov_embed @ W2.T)`` as ``[rows, vocab_limit]``.

    ``out`` may instead be ``[rows, n]`` with ``vocab_limit <= n <= vocab`` (bf16 or fp32,
    last dim contiguous): columns at or beyond ``vocab_limit`` are then written as -inf.
    """
    limit = _check_inputs(x, head, markov_embed, markov_weight, vocab_limit)
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, limit, dtype=out_dtype, device=x.device)
    if out.dtype not in (torch.bfloat16, torch.float32) or out.stride(1) != 1:
        raise ValueError("out must be bf16 or fp32 with a contiguous last dimension")
    if out.shape[0] != rows or not limit <= out.shape[1] <= head.vocab:
        raise ValueError(f"out must be [{rows}, n] with {limit} <= n <= {head.vocab}")
    config = _pick_config(config, rows, head, markov_embed is not None)
    if rows == 0:
        return out
    workspace = _workspace_for(workspace, rows, head)
    if config.cublas:
        out[:, :limit].copy_(_cublas_logits(x, head, workspace, out.dtype)[:, :limit])
        out[:, limit:].fill_(float("-inf"))
        return out
    _launch_tiles(
        x, head, markov_embed, markov_weight, limit, out.shape[1], config, workspace, out=out
    )
    return out


def fp8_head_argmax(
    x: torch.Tensor,
    head: Fp8RowwiseWeight,
    *,
    markov_embed: torch.Tensor | None = None,
    markov_weight: torch.Tensor | Fp8RowwiseWeight | None = None,
    vocab_limit: int | None = None,
    out_index: torch.Tensor | None = None,
    out_value: torch.Tensor | None = None,
    workspace: HeadWorkspace | None = None,
    config: HeadTileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy draft tokens: ``(index int64 [rows], max logit fp32 [rows])`` (the value rounded
    to bf16 on the cuBLAS route), no [rows, vocab] logits written by the Triton tiles.

    Ties go to the lowest index; a row with a NaN or infinite logit gives (-1, NaN). Indices
    are local to ``head`` (a tensor-parallel caller adds its shard offset and keeps the
    largest value).
    """
    limit = _check_inputs(x, head, markov_embed, markov_weight, vocab_limit)
    rows = x.shape[0]
    if out_index is None:
        out_index = torch.empty(rows, dtype=torch.int64, device=x.device)
    if out_value is None:
        out_value = torch.empty(rows, dtype=torch.float32, device=x.device)
    if (
        out_index.dtype != torch.int64
        or out_index.shape != (rows,)
        or not out_index.is_contiguous()
    ):
        raise ValueError(f"out_index must be contiguous int64 of shape ({rows},)")
    if (
        out_value.dtype != torch.float32
        or out_value.shape != (rows,)
        or not out_value.is_contiguous()
    ):
        raise ValueError(f"out_value must be contiguous float32 of shape ({rows},)")
    config = _pick_config(config, rows, head, markov_embed is not None)
    if rows == 0:
        return out_index, out_value
    workspace = _workspace_for(workspace, rows, head)
    if config.cublas:
        logits = _cublas_logits(x, head, workspace)[:, :limit]
        index = logits.argmax(dim=-1)  # the first maximum: ties go to the lowest index
        value = logits.gather(1, index[:, None]).squeeze(1).float()
        # The value is the bf16 logit (8 mantissa bits). A NaN row's argmax lands on a
        # NaN, an infinite one on +inf; -inf elsewhere in a row is not looked for here.
        bad = ~torch.isfinite(value)
        out_index.copy_(torch.where(bad, -1, index))
        out_value.copy_(torch.where(bad, float("nan"), value))
        return out_index, out_value
    num_tiles = triton.cdiv(limit, config.block_v)
    part_value = workspace.part_value[: rows * num_tiles].view(rows, num_tiles)
    part_index = workspace.part_index[: rows * num_tiles].view(rows, num_tiles)
    _launch_tiles(
        x,
        head,
        markov_embed,
        markov_weight,
        limit,
        limit,
        config,
        workspace,
        part_value=part_value,
        part_index=part_index,
    )
    block_t = triton.next_power_of_2(num_tiles)
    _argmax_finalize_kernel[(rows,)](
        part_value,
        part_index,
        out_index,
        out_value,
        num_tiles,
        num_tiles,
        BLOCK_T=block_t,
        num_warps=4 if block_t <= 2048 else 8,
    )
    return out_index, out_value
