"""The host's view of a compacted batch, for attention builders that read host lengths.

A compacted step's per-request query lengths are chosen on the GPU
(:mod:`vllm_dspark.verify.compaction`); the host knows only how many decoding requests
lead the batch (R), how many drafts they verify in all (the plan's budget B) and the
exact lengths of the prompt requests after them. Builders that split decodes from
prefills or size their rows on the host (DeepSeek-V4's) get a placeholder layout that
agrees with the device layout wherever they read it:

- the decoding rows sum to R + B and each is at most 1 + K (their stock length) and at
  least 1, so the host total and maximum are the device's total and a bound on its rows;
- the drafts are placed on the first rows, K each, so R > 1 decoding rows with 0 < B < RK
  never all have the same length (a uniform host layout would tell DeepSeek-V4's indexer
  that token i belongs to request i // (1 + K));
- prompt rows keep their lengths and move up by the drafts dropped; padded rows are empty.

:func:`token_requests` maps tokens to requests from the device offsets instead.
"""

from __future__ import annotations

import numpy as np
import torch


def placeholder_query_lens(stock_lens: np.ndarray, decodes: int, budget: int) -> np.ndarray:
    """Per request, the placeholder query length of a step whose first ``decodes``
    requests (stock length 1 + K each) verify ``budget`` drafts in all; the others'
    lengths are kept."""
    drafts = stock_lens[:decodes].astype(np.int64) - 1
    if not 0 <= budget <= drafts.sum():
        raise ValueError(f"{budget} drafts do not fit {decodes} requests of {drafts.tolist()}")
    before = np.cumsum(drafts) - drafts  # drafts the earlier rows could take
    lens = stock_lens.astype(np.int32)  # a copy
    lens[:decodes] = 1 + np.clip(budget - before, 0, drafts)
    return lens


def placeholder_query_start_loc(query_lens: np.ndarray, num_rows: int) -> np.ndarray:
    """Query offsets of ``query_lens`` over ``num_rows`` batch rows (padded rows empty)."""
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1 : len(query_lens) + 1])
    query_start_loc[len(query_lens) + 1 :] = query_start_loc[len(query_lens)]
    return query_start_loc


def token_requests(query_start_loc: torch.Tensor, num_reqs: int, out: torch.Tensor) -> None:
    """Write into ``out`` (int32, one entry per token) the batch row of each token, read
    from the device query offsets (``num_reqs + 1`` of them); tokens past the last
    request's end (padding) get row 0, a real one, as vLLM's host map gives them. No host
    sync."""
    tokens = torch.arange(out.shape[0], dtype=query_start_loc.dtype, device=out.device)
    # The row of a token: how many requests end at or before it.
    ends = query_start_loc[1 : num_reqs + 1]
    torch.searchsorted(ends, tokens, right=True, out_int32=True, out=out)
    out.masked_fill_(out >= num_reqs, 0)
