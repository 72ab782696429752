"""Per-step device statistics read on the host one step late, without stalling the GPU.

Capacity control plans each step on the host from what earlier steps measured on the
device: the number of drafts a proposal wants verified (slots above the threshold, or the
SPS-optimal count) or the drafts its requests had accepted. Each real proposal ends with
such a (total, requests) pair, the total a device scalar copied to pinned host memory
with ``non_blocking=True`` and marked by a CUDA event. The host reads it when it plans a
later step: the step that verifies proposal p reads the record of proposal p - 1, whose
drafts were sampled, and verified, before those of p. So the budget is a function of the
past only, which keeps the allocation lossless (see :mod:`vllm_dspark.capacity.allocation`).
The read waits on that record's event: the step that made it finished before the host,
at most one step ahead of the GPU, plans this one, so the wait is for work already done,
and every tensor-parallel rank reads the same value (a read that fell back to an older
value when a copy was late would let ranks pick different batch sizes and hang).

The statistic is read per request, so a batch that grew or shrank since gets a budget in
proportion to its size. A record holds one value or a vector (one per draft position).
:class:`StaleSnapshot` reads a whole proposal's survivals the same way, now and then.
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

    def per_request(self) -> float | list[float]:
        """The total per request of the proposal before the last one (at first, the
        initial value)."""
        if self.proposals >= 2:
            slot = (self.proposals - 2) % 2
            event = self._events[slot]
            if event is not None:
                event.synchronize()
            *totals, num_reqs = self._records[slot].tolist()
            if num_reqs > 0:  # a step with no request to count keeps the last value
                per_request = [total / num_reqs for total in totals]
                self._per_request = per_request[0] if self._scalar else per_request
        return self._per_request


class StaleSnapshot:
    """One proposal's [R, K] survivals, copied to pinned host memory without a sync and read
    at a later step, after the copy's event (work already done, as for
    :class:`StalePerRequest`). One snapshot at a time: a proposal's is taken only once the
    last was read, so the one read is the first proposal's after the previous read."""

    def __init__(self, max_num_reqs: int, num_drafts: int, device: torch.device):
        cuda = device.type == "cuda"
        self._buffer = torch.zeros(max_num_reqs, num_drafts, dtype=torch.float32, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._rows: int | None = None  # the rows of the snapshot waiting to be read

    def take(self, survival: torch.Tensor) -> None:
        """After a real proposal: its survivals, unless a snapshot waits to be read."""
        if self._rows is not None:
            return
        self._rows = survival.shape[0]
        self._buffer[: self._rows].copy_(survival, non_blocking=True)
        if self._event is not None:
            self._event.record()

    def read(self) -> torch.Tensor | None:
        """The waiting snapshot (a CPU tensor), or None; frees the slot for the next."""
        if self._rows is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        snapshot, self._rows = self._buffer[: self._rows].clone(), None
        return snapshot
