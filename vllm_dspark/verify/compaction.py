"""Compact a uniform verification batch to the drafts capacity control admitted.

vLLM schedules every decoding request with K draft slots: in a decode-only step the
target's inputs are laid out uniformly, request r owning tokens r*(1+K) .. r*(1+K)+K
(its last sampled token, then its K drafts). Capacity control admits k_r <= K drafts
per request. The compact layout keeps, per request, its first 1 + k_r tokens, packed
without padding:

    uniform  r0: [b d1 d2 d3]  r1: [b d1 d2 d3]  r2: [b d1 d2 d3]      (K = 3)
    k        r0: 2             r1: 0             r2: 3
    compact  [b d1 d2 | b | b d1 d2 d3]

Everything per token (input ids, positions, KV slot mappings, the logits to verify)
is gathered from the uniform layout by :attr:`CompactLayout.source`; per request, the
query offsets and sequence lengths shrink by the drafts dropped. The total number of
tokens, R + sum(k_r), must be known on the host (the budget modes fix it), so nothing
here synchronises with the host and all of it can run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompactLayout:
    source: torch.Tensor  # [T] int64: uniform-layout index of each compact token
    request: torch.Tensor  # [T] int64: the request (batch row) of each compact token
    offset: torch.Tensor  # [T] int64: position of the token within its request's query
    query_start_loc: torch.Tensor  # [R + 1] int32: compact query offsets
    dropped: torch.Tensor  # [R] int64: drafts of each request not verified (K - k_r)


def compact_layout(capacity: torch.Tensor, num_drafts: int, num_tokens: int) -> CompactLayout:
    """The compact layout of ``num_tokens`` = R + sum(capacity) tokens. capacity: [R]."""
    capacity = capacity.long()
    lengths = 1 + capacity
    starts = torch.cumsum(lengths, dim=0) - lengths
    token = torch.arange(num_tokens, device=capacity.device)
    # Request of each token: how many requests start at or before it, minus one.
    request = torch.searchsorted(starts, token, right=True) - 1
    offset = token - starts[request]
    query_start_loc = torch.zeros(len(capacity) + 1, dtype=torch.int32, device=capacity.device)
    query_start_loc[1:] = torch.cumsum(lengths, dim=0)
    return CompactLayout(
        source=request * (1 + num_drafts) + offset,
        request=request,
        offset=offset,
        query_start_loc=query_start_loc,
        dropped=num_drafts - capacity,
    )


def compact_tokens(values: torch.Tensor, layout: CompactLayout) -> torch.Tensor:
    """Per-token values (last dimension: tokens) in the compact layout."""
    return values.index_select(-1, layout.source)


def compact_seq_lens(seq_lens: torch.Tensor, layout: CompactLayout) -> torch.Tensor:
    """Sequence lengths once each request's unverified drafts are gone."""
    return seq_lens - layout.dropped.to(seq_lens.dtype)
