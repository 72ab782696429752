"""One Triton kernel for the confidence logit of one draft position.

The head (:class:`~vllm_dspark.capacity.confidence.ConfidenceHead`) dots
[h_k ; markov_w1[x_{k-1}] ; l_k ; log(1 - e^l_k)] with its weight row, where l_k, the
draft distribution's top-1 log-probability, reduces over the whole vocabulary. In PyTorch
that is about 15 launches per position (the logits cast to fp32, amax, logsumexp's own,
the statistics, the concatenation, the product), 105 per proposal of 7 drafts, and at 256
requests over a 152k vocabulary five passes per position over a 155 MB fp32 copy of the
logits. Here one program per row reads the logits once as they are (bf16), keeping a
running maximum and sum of exponentials per lane, and dots the row's features with the
weight row in the same program: one launch per position, inside the captured draft graph.
:class:`ConfidenceHead` keeps the PyTorch definition, which the CPU path and the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Lanes of the vocabulary loop, and of the hidden and Markov dot products.
BLOCK_V = 2048
BLOCK_FEATURES = 1024
# A running maximum that starts finite: exp(m - m_new) is never exp(-inf + inf).
_START_MAX = tl.constexpr(-3.0e38)


@triton.jit
def _dot(ptr, stride_row, row, weight_ptr, size, BLOCK: tl.constexpr):
    """sum_i x[row, i] * w[i] in fp32, over ``size`` features."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < size
        x = tl.load(ptr + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=inside, other=0.0)
        acc += x * w
    return tl.sum(acc, axis=0)


@triton.jit
def _confidence_logit_kernel(
    logits_ptr,  # [R, V], rows ``logits_stride`` apart
    logits_stride,
    vocab,
    hidden_ptr,  # [R, H], rows ``hidden_stride`` apart
    hidden_stride,
    hidden_size,
    markov_ptr,  # [R, r], rows ``markov_stride`` apart
    markov_stride,
    rank,
    weight_ptr,  # [H + r + statistics] fp32: the position's row
    bias_ptr,  # fp32: the position's bias
    out_ptr,  # [R] fp32, ``out_stride`` apart
    out_stride,
    top1_cap,
    READS_LOGPROB: tl.constexpr,
    READS_MISS_LOGPROB: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_FEATURES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z = tl.load(bias_ptr)
    z += _dot(hidden_ptr, hidden_stride, row, weight_ptr, hidden_size, BLOCK_FEATURES)
    z += _dot(markov_ptr, markov_stride, row, weight_ptr + hidden_size, rank, BLOCK_FEATURES)
    if READS_LOGPROB or READS_MISS_LOGPROB:
        # l = max - logsumexp = -log(sum_v exp(x_v - max)).
        running_max = tl.full([BLOCK_V], _START_MAX, dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(
                logits_ptr + row * logits_stride + cols, mask=cols < vocab, other=float("-inf")
            ).to(tl.float32)
            new_max = tl.maximum(running_max, x)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
            running_max = new_max
        top_max = tl.max(running_max, axis=0)
        top1 = -tl.log(tl.sum(running_sum * tl.exp(running_max - top_max), axis=0))
        statistic = weight_ptr + hidden_size + rank
        if READS_LOGPROB:
            z += top1 * tl.load(statistic)
            statistic += 1
        if READS_MISS_LOGPROB:
            # Capped at log(0.999): 1 - e^l loses at most ~1e-4 of itself to rounding.
            miss = 1.0 - tl.exp(tl.minimum(top1, top1_cap))
            z += tl.log(miss) * tl.load(statistic)
    tl.store(out_ptr + row * out_stride, z)


def confidence_logit(
    hidden: torch.Tensor,
    markov_embed: torch.Tensor,
    logits: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    reads_logprob: bool,
    reads_miss_logprob: bool,
    top1_cap: float,
) -> torch.Tensor:
    """z = [hidden ; markov_embed ; statistics of logits] . weight + bias per row:
    [R, H], [R, r], [R, V], fp32 [H + r + statistics], fp32 0-d -> fp32 [R]."""
    rows = hidden.shape[0]
    out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    if rows == 0:
        return out
    # Rows may lie apart (a position's slice of [R, K, H]); each row's elements may not.
    hidden, markov_embed, logits = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (hidden, markov_embed, logits)
    )
    _confidence_logit_kernel[(rows,)](
        logits,
        logits.stride(0),
        logits.shape[-1],
        hidden,
        hidden.stride(0),
        hidden.shape[-1],
        markov_embed,
        markov_embed.stride(0),
        markov_embed.shape[-1],
        weight,
        bias,
        out,
        out.stride(0),
        top1_cap,
        READS_LOGPROB=reads_logprob,
        READS_MISS_LOGPROB=reads_miss_logprob,
        BLOCK_V=BLOCK_V,
        BLOCK_FEATURES=BLOCK_FEATURES,
        num_warps=8,
    )
    return out
