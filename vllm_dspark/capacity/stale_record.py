"""Per-step device statistics read on the host one step late, without stalling the GPU.

Capacity control plans each step on the host from what earlier steps measured on the
device (the drafts a proposal wants verified, or the drafts its requests accepted). Each
real proposal ends with a (total, requests) record: the total copied to pinned host memory
with ``non_blocking=True`` and marked by a CUDA event. The step that verifies proposal p
reads the record of proposal p - 1, so the budget depends on the past only, which keeps the
allocation lossless (:mod:`vllm_dspark.capacity.allocation`). The read waits on the record's
event, for work already done (the host runs at most one step ahead), so every
tensor-parallel rank reads the same value; falling back to an older value when a copy was
late would let ranks pick different batch sizes and hang. The statistic is per request, so
a batch that changed size gets a budget in proportion. :class:`StaleSnapshots` reads whole
proposals' survivals the same way.
"""

from __future__ import annotations

import torch


class StalePerRequest:
    def __init__(self, device: torch.device, initial_per_request: float | list[float]):
        cuda = device.type == "cuda"
        self._scalar = not isinstance(initial_per_request, list)
        width = 1 if self._scalar else len(initial_per_request)
        # Two records, (total..., requests), written alternately by successive steps.
        self._records = torch.zeros(2, width + 1, dtype=torch.float32, pin_memory=cuda)
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.proposals = 0  # records made
        self._per_request = initial_per_request

    def record(self, total: torch.Tensor, num_reqs: torch.Tensor | int) -> None:
        """After a real step: its total (device scalar, or vector of the record's width)
        over ``num_reqs`` requests."""
        slot = self.proposals % 2
        self._records[slot, :-1].copy_(total.reshape(-1), non_blocking=True)
        if isinstance(num_reqs, torch.Tensor):
            self._records[slot, -1].copy_(num_reqs, non_blocking=True)
        else:
            self._records[slot, -1] = num_reqs
        event = self._events[slot]
        if event is not None:
            event.record()
        self.proposals += 1

    @property
    def record_read(self) -> int:
        """The index of the record :meth:`per_request` reads: the one before the last
        (negative while there is none, and it reads the initial value)."""
        return self.proposals - 2

    def per_request(self) -> float | list[float]:
        """The total per request of the proposal before the last one (at first, the
        initial value)."""
        if self.record_read >= 0:
            slot = self.record_read % 2
            event = self._events[slot]
            if event is not None:
                event.synchronize()
            *totals, num_reqs = self._records[slot].tolist()
            if num_reqs > 0:  # a step with no request to count keeps the last value
                per_request = [total / num_reqs for total in totals]
                self._per_request = per_request[0] if self._scalar else per_request
        return self._per_request


class StaleSnapshots:
    """Proposals' [R, K] survivals, copied to pinned host memory without a sync and read two
    proposals later, as :class:`StalePerRequest` reads its records: that proposal's step
    finished before the host plans this one, so the wait on its event is for work done."""

    def __init__(self, max_num_reqs: int, num_drafts: int, device: torch.device):
        cuda = device.type == "cuda"
        shape = (2, max_num_reqs, num_drafts)
        self._buffers = torch.zeros(shape, dtype=torch.float32, pin_memory=cuda)
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._rows: list[int | None] = [None, None]  # per slot: a snapshot's rows, unread
        self.proposals = 0

    def exchange(self, survival: torch.Tensor | None) -> torch.Tensor | None:
        """At a real proposal: the snapshot taken two proposals ago, if one was (a CPU
        tensor); then this proposal's ``survival`` is taken, if given."""
        slot = self.proposals % 2
        self.proposals += 1
        earlier, rows = None, self._rows[slot]
        if rows is not None:
            if self._events[slot] is not None:
                self._events[slot].synchronize()
            earlier = self._buffers[slot, :rows].clone()
        self._rows[slot] = None
        if survival is not None:
            self._rows[slot] = survival.shape[0]
            self._buffers[slot, : survival.shape[0]].copy_(survival, non_blocking=True)
            if self._events[slot] is not None:
                self._events[slot].record()
        return earlier
