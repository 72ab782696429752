"""Plain decode steps while the draft gate (sps or acceptance) is closed (plain_steps).

With the gate closed, a proposal drafts nothing and the step after it verifies nothing,
yet vLLM still schedules that step as a speculative one: 1 + K tokens per request through
input preparation, K KV slots each, the speculative sampling path and compaction down to
one token per request. On the embedded pair at 256 requests such a step took 8.8 ms
against 4.9 ms for a step of no speculation (06f3fff, H200). A step scheduled with no
drafts is vLLM's plain decode step instead.

Who decides: the scheduler, so that every rank runs the same step. vLLM's scheduler
already chooses how many drafts the next step verifies, through Dynamic SD's lookup
(batch size -> drafts; ``SchedulerOutput.num_spec_tokens_to_schedule``, which the async
scheduler turns into the next step's draft placeholders). The worker's gate reports its
verdict on each step's output (K: draft, 0: don't); on a 0 the scheduler takes
:data:`CLOSED` as its lookup, on a K it goes back to the one it had. The worker in turn
drafts only when the step it proposes for verifies drafts. The verdict reaches the
scheduler a step or two late, which is harmless: what a step verifies never depends on
the drafts being verified, so the output stays exactly the target's.

What the gate weighs against drafting is then a plain step's cost, which speculative steps
cannot show (:mod:`step_overhead` fits it from plain steps alone). So that it is known
before the gate has ever closed, :class:`PlainCostProbe` closes an open gate for a few
proposals in a row whenever the batch size enters a range (a power of two) whose plain
steps were not measured, and every ``PLAIN_REFRESH`` proposals: a handful of plain steps
in a thousand, where drafting pays, is what knowing when it stops paying costs. Not where
drafting beats even a plain step that costs nothing beyond the target's forward (the gate
tells, ``DraftGate.beats_any_plain_step``): no measured cost could close the gate there,
and each plain step would only lose what drafting gains (at one request on the Qwen3-8B
shape, 2.6x). It counts proposals and reads the batch size and the gate's verdicts, the
same on every rank.

The Dynamic SD table :func:`dynamic_sd_table` gives the engine K drafts at every real
batch size, plus a 0 past any of them: vLLM then also captures FULL decode CUDA graphs
of one token per request, which the plain steps replay. Data parallelism is refused, as
vLLM refuses Dynamic SD there (ranks choosing different counts deadlock). The drafter's
graph managers are built without the table (:func:`without_dynamic_sd_table`): vLLM would
give them a graph per count in it too, though the drafter always runs its one query
length, and the 0 makes that length 0 for DSpark's anchor-first layout (K queries per
request), whose graph rounding then divides by zero at start-up.
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
