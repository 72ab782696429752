"""Plain decode steps while the draft gate (sps or acceptance) is closed (plain_steps).

With the gate closed, a proposal drafts nothing, yet vLLM would still schedule the next step
as a speculative one (1 + K tokens per request through input preparation, K KV slots each,
the speculative sampling path, compaction down to one token), far dearer than a plain
decode step. So the scheduler, which every rank follows, runs vLLM's plain step instead:
the worker's gate reports its verdict on each step's output (K: draft, 0: don't), and on a 0
the scheduler takes :data:`CLOSED` as its Dynamic SD lookup (batch size -> drafts). The
verdict arrives a step or two late, which is harmless: what a step verifies never depends
on the drafts being verified, so the output stays exactly the target's.

The gate then weighs a plain step's cost, which speculative steps cannot show; so that it is
known before the gate ever closes, :class:`PlainCostProbe` closes an open gate for a few
proposals whenever the batch size enters an unmeasured power-of-two range, and every
``PLAIN_REFRESH`` proposals, except where drafting beats even a free plain step.
:func:`dynamic_sd_table` gives the engine K drafts at every real batch size and 0 past them,
so that vLLM captures the one-token decode graphs the plain steps replay; the drafter's
graph managers are built without it (:func:`without_dynamic_sd_table`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")


# Past any real batch size (vLLM's lookup stops at max_num_seqs).
BEYOND_ANY_BATCH = 1 << 20
# Proposals an open gate reports closed in a row to have plain steps measured (the
# scheduler follows a step or two late, and the first plain step's period is a transition).
PLAIN_BURST = 8
PLAIN_REFRESH = 1024  # proposals after which plain steps are measured again


class PlainCostProbe:
    """Closes an open draft gate now and then, so that plain steps run and are timed."""

    def __init__(self):
        self.measured_ranges: set[int] = set()  # batch sizes' bit lengths
        self.since_measured = 0
        self.burst_left = 0

    def closes(self, num_reqs: int, gate_open: bool, decided: bool = False) -> bool:
        """Whether the coming proposal is reported closed although the gate is open
        (``decided``: the gate drafts whatever a plain step costs; no probe then)."""
        self.since_measured += 1
        batch_range = num_reqs.bit_length()
        if not gate_open:  # plain steps follow anyway and are timed
            self.measured_ranges.add(batch_range)
            self.since_measured = self.burst_left = 0
            return False
        if decided:
            self.burst_left = 0
            return False
        stale = self.since_measured >= PLAIN_REFRESH
        if self.burst_left == 0 and (batch_range not in self.measured_ranges or stale):
            self.measured_ranges.add(batch_range)
            self.since_measured, self.burst_left = 0, PLAIN_BURST
        if self.burst_left == 0:
            return False
        self.burst_left -= 1
        return True


def dynamic_sd_table(num_drafts: int) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for plain steps: K at every batch
    size, and 0 (so that one-token decode graphs are captured) where no batch reaches."""
    return [(1, BEYOND_ANY_BATCH, num_drafts), (BEYOND_ANY_BATCH + 1, BEYOND_ANY_BATCH + 1, 0)]


class ClosedGateLookup:
    """Stands in for the scheduler's Dynamic SD lookup while the gate is closed: no
    drafts at any batch size."""

    def __getitem__(self, batch_size: int) -> int:
        return 0


CLOSED = ClosedGateLookup()


def schedule_next(scheduler, num_drafts: int) -> None:
    """Scheduler side: the worker's latest verdict, K or 0 drafts for the coming steps."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    if not isinstance(scheduler, AsyncScheduler):
        # The synchronous scheduler schedules the drafts the worker returned, all K.
        if num_drafts == 0 and not getattr(scheduler, "_dspark_warned_sync", False):
            scheduler._dspark_warned_sync = True
            logger.warning(
                "vllm-dspark: dspark_plain_steps needs async scheduling; steps stay "
                "speculative while the draft gate is closed."
            )
        return
    if num_drafts == 0 and scheduler.dynamic_sd_lookup is not CLOSED:
        scheduler.dspark_open_lookup = scheduler.dynamic_sd_lookup
        scheduler.dynamic_sd_lookup = CLOSED
    elif num_drafts > 0 and scheduler.dynamic_sd_lookup is CLOSED:
        scheduler.dynamic_sd_lookup = scheduler.dspark_open_lookup


@contextmanager
def without_dynamic_sd_table(vllm_config) -> Iterator[None]:
    """While the drafter's CUDA-graph managers list their graphs: no Dynamic SD table."""
    speculative_config = vllm_config.speculative_config
    table = speculative_config.num_speculative_tokens_per_batch_size
    speculative_config.num_speculative_tokens_per_batch_size = None
    try:
        yield
    finally:
        speculative_config.num_speculative_tokens_per_batch_size = table
