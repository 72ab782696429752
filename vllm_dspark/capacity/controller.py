"""Capacity control: how many of a step's drafts the target verifies, and whether and
how deep the drafter proposes. :class:`CapacityController` owns all of its state; the
runner patches and the speculators talk to it through a few methods.

Per decode step the runner asks :meth:`CapacityController.plan_step` for the number B of
drafts to verify (on the host, before the step), then :meth:`~CapacityController.admit_step`
for how they split over the requests (on the device). The modes:

- ``budget``: B = ceil(R*K*budget_frac), split by proposal-time survival;
- ``threshold`` / ``sps``: B from the previous proposal's wanted count
  (:mod:`vllm_dspark.capacity.allocation`), split by survival;
- ``acceptance``: every request verifies d drafts, d chosen from the recent acceptance
  per position and the SPS curve (:mod:`vllm_dspark.capacity.acceptance`); needs no
  confidence head.

``sps``, ``acceptance`` and the draft gate (:mod:`draft_gate`, which may skip a proposal
under load) weigh each step's time: the target's SPS curve, the profiled proposal time
and what the step costs outside both (:mod:`step_overhead`). The depth a proposal
computes is :mod:`depth_control`'s; what the engine must support, :mod:`startup_checks`'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger

from vllm_dspark.capacity.acceptance import AcceptanceDepth
from vllm_dspark.capacity.allocation import (
    UNCOMPUTED_SURVIVAL,
    admission_budget,
    budget_capacity,
    masked_forward_table,
    padded_to_graph_sizes,
    sps_best_count,
    sps_table_from_curve,
    threshold_count,
)
from vllm_dspark.capacity.depth_control import DepthControl
from vllm_dspark.capacity.draft_gate import (
    PLAIN_PROBE_BURST,
    SURVIVAL_MEMORY,
    DraftGate,
    SlowestRequest,
    SurvivalAverage,
    draft_seconds_table,
    proposal_seconds,
)
from vllm_dspark.capacity.physical_depth import WINDOW_STEPS, PhysicalDepth
from vllm_dspark.capacity.plain_steps import PlainCostProbe
from vllm_dspark.capacity.proposal_kernel import proposal_stats
from vllm_dspark.capacity.rest import AdmissionRest
from vllm_dspark.capacity.stale_record import StalePerRequest, StaleSnapshots
from vllm_dspark.capacity.startup_checks import (
    check_compaction_supported,
    graph_sizes,
    has_full_decode_graphs,
    refuse_sps_profiling,
)
from vllm_dspark.capacity.step_overhead import StepOverhead
from vllm_dspark.capacity.verification_kernel import (
    Verification,
    drafted_counts,
    verification_stats,
)
from vllm_dspark.config import KEY_PREFIX, DSparkOptions
from vllm_dspark.triton_path import use_triton

logger = init_logger(__name__)

# Modes that weigh the target's SPS curve and the step's time outside it.
CURVE_MODES = ("sps", "acceptance")

# The admission fingerprint's modulus (2^31 - 1) and multiplier: products fit in int64.
_FINGERPRINT_MOD = 2_147_483_647
_FINGERPRINT_MUL = 1_000_003

# sps measuring its overhead: one step in this many verifies half its admitted drafts.
EXPLORE_EVERY = 64
# ... counting only steps that verify at least this many drafts: below it the time per
# draft cannot move a decision, so a varied step would only lose tokens
# (docs/design/module-notes.md).
EXPLORE_MIN_DRAFTS = 32


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What the runner knows of a scheduled step before it runs."""

    num_reqs: int  # requests scheduled
    num_tokens: int  # tokens scheduled
    num_drafting: int  # requests scheduled with drafts
    plain_decode: bool  # one token per running request and no drafts
    next_step_drafts: int  # drafts the scheduler gave the step after this one
    # The requests that decode with all K drafts where the step can be compacted (None: it
    # cannot); asked only when the answer matters (it walks the batch on the host).
    count_decoding: Callable[[], int | None]


@dataclasses.dataclass(frozen=True)
class TimedStep:
    """A planned step as the step-time fit reads it (:mod:`step_overhead`)."""

    tokens: int  # what its forward runs: decoding tokens verified, then prompt tokens
    requests: int  # decoding requests
    prompt_tokens: int = 0
    plain: bool = False  # a plain decode step (:mod:`plain_steps`)
    compacted: bool = False  # its batch is compacted to what it verifies

    @property
    def drafts(self) -> int:
        return self.tokens - self.requests - self.prompt_tokens


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a decode step verifies: ``budget`` of its drafts, compacted or ``masked``."""

    budget: int
    # The forward runs every draft and only the admitted ones are verified
    # (``dspark_varlen_verify=false``); else the batch is compacted to them.
    masked: bool = False
    # In a compacted step that also carries prompts: (its decoding requests, which lead
    # the batch, and its tokens once compacted); None in a decode-only step.
    mixed: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class ProposalPlan:
    drafting: bool  # whether the proposal drafts (else placeholders nothing verifies)
    resting: bool  # sps at rest: the proposal's survivals are neither read nor recorded


class CapacityController(DepthControl):
    """All capacity-control state of one speculator, and the only object vLLM's runner
    patches and the speculator ask about it. Per decode step the runner patches call
    :meth:`plan_step` (on the host: what the step verifies, in which layout) and
    :meth:`admit_step` (on the device: k_r per request); the speculator calls
    :meth:`plan_proposal` before each proposal (whether and how deep it drafts, after
    taking in what the step just run verified and how long it took) and
    :meth:`observe_proposal` after it (its survivals). ``previous``: the controller this
    one replaces in a running engine, whose measured costs and profiles it keeps."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        options: DSparkOptions,
        num_drafts: int,
        max_num_reqs: int,
        previous: CapacityController | None = None,
    ) -> None:
        self.vllm_config, self.device, self.options = vllm_config, device, options
        self.num_speculative_steps, self.max_num_reqs = num_drafts, max_num_reqs
        # Positions the next proposal computes: all K unless the speculator captured a
        # draft graph per depth (``varies_depth``, set by the speculator).
        self.draft_depth = num_drafts
        self.varies_depth = previous.varies_depth if previous is not None else False
        # Called with (slots, drafts verified, drafts accepted) per verified step, set by a
        # speculator that reads them (calibration metrics, online STS: its
        # record_calibration, at load and after every switch).
        self.verification_reader = None
        self.controls_capacity = options.capacity != "off"
        # Per request slot: the survival of the drafts it waits to have verified.
        self.slot_survival = torch.ones(
            (self.max_num_reqs, num_drafts), dtype=torch.float32, device=device
        )
        # threshold and sps: the budget comes from the previous proposal.
        self.stale_budget = None
        if options.capacity in ("threshold", "sps"):
            self.stale_budget = StalePerRequest(device, options.budget_frac * num_drafts)
        # sps: resting while every draft is worth verifying (rest.py).
        self.rest = AdmissionRest() if options.capacity == "sps" else None
        self.sps_table = None
        self.sps_table_host = None
        # sps: the step's time outside the curve, measured once per engine (switched
        # between arms, it keeps the host's costs); plan_step sets what the running step
        # runs (None: a step the curve does not describe).
        self.measured_overhead = previous.measured_overhead if previous else None
        self.step_overhead = None
        self.timed_step: TimedStep | None = None
        self.steps_since_varied = 0
        uses_curve = options.capacity in CURVE_MODES
        if uses_curve and options.step_overhead_ms == "auto":
            if self.measured_overhead is None:
                self.measured_overhead = StepOverhead(device, None, _tp_reduce_max())
            self.step_overhead = self.measured_overhead
        elif uses_curve:
            self.step_overhead = StepOverhead(device, options.step_overhead_ms / 1000.0)
        # sps_curve=auto: profiled once the target's graphs are captured (set_sps_curve);
        # a controller that replaces one switched to auto reuses its profile.
        self.profiled_sps_curve = previous.profiled_sps_curve if previous else None
        auto_sps = uses_curve and options.sps_curve == "auto"
        self.needs_sps_profile = auto_sps and self.profiled_sps_curve is None
        if self.needs_sps_profile and not has_full_decode_graphs(vllm_config):
            if options.capacity == "sps":
                refuse_sps_profiling(vllm_config)
            # acceptance keeps working without graphs, on its length rule.
            logger.warning(
                "vllm-dspark: no FULL decode CUDA graph to profile the SPS curve; "
                "%scapacity=acceptance follows the accepted length alone.",
                KEY_PREFIX,
            )
            self.needs_sps_profile = False
        elif auto_sps and self.profiled_sps_curve is not None:
            self.set_sps_curve(self.profiled_sps_curve, device)
        elif uses_curve and options.sps_curve != "auto":
            self.set_sps_curve(options.sps_curve, device)
        # Whether to draft at all (sps with profiled costs), and whether the last proposal
        # did: the step verifying a skipped proposal verifies nothing.
        self.profiled_draft_ms = previous.profiled_draft_ms if previous else None
        self.draft_tables: dict[int, torch.Tensor] = {}  # seconds per proposal, per depth
        self.draft_gate = None
        self.slowest_request: SlowestRequest | None = None  # gate_objective=batch
        self.drafted_last = True
        self.proposals_skipped = 0
        # Real proposals that drafted, by the depth they computed (index d - 1): where
        # dynamic depth spent a run's steps, which its final depth alone does not show.
        self.proposals_at_depth = [0] * num_drafts
        # Per decode step while a benchmark traces one batch (None: not tracing):
        # what each step decided and on what (:meth:`trace_step`).
        self.step_trace: list[list] | None = previous.step_trace if previous else None
        # plain_steps: the drafts the scheduler gave the next step (plan_step
        # sets it; None: not known), and the gate's verdict for the scheduler. K at first,
        # so that an engine switched away from plain steps schedules drafts again.
        self.next_step_drafts = None
        self.gate_report = num_drafts
        self.gate_depth = num_drafts  # the depth the draft gate last let a proposal draft
        self.open_verdict_pending = False
        self.full_probe_next = False  # sps: whether the next probe verifies all R K drafts
        self.plain_cost_probe = PlainCostProbe() if options.plain_steps else None
        # acceptance: a depth from verified steps' acceptance per position (their counts
        # of verifications reaching, then accepting, each position: 2 K values).
        self.acceptance = None
        if options.capacity == "acceptance":
            self.acceptance = AcceptanceDepth(num_drafts)
            self.stale_position_counts = StalePerRequest(device, [0.0] * (2 * num_drafts))
            self.position_counts_read = 0
        if auto_sps and self.profiled_draft_ms is not None:
            self.set_draft_cost(self.profiled_draft_ms)
        # dynamic_depth: sequential positions the drafter computes, from recent admissions
        # (acceptance: the depth it will verify, planned before each proposal).
        self.physical_depth = None
        if options.dynamic_depth and self.acceptance is None:
            self.physical_depth = PhysicalDepth(num_drafts)
            self.stale_max_admitted = StalePerRequest(device, float(num_drafts))
        # sps: whole proposals' survivals on the host, about SURVIVAL_MEMORY requests' per
        # WINDOW_STEPS proposals (the rows taken at each of the last ones), for the draft
        # gate (the latest) and the depth that pays (physical_depth.py: per depth, the sum
        # of their best expected tokens per second over the current window).
        self.survival_snapshots = None
        self.snapshot_rows: deque[int] = deque(maxlen=WINDOW_STEPS)
        self.gate_snapshot: torch.Tensor | None = None
        # Read since the window's start (at most a window's proposals).
        self.depth_snapshots: deque[torch.Tensor] = deque(maxlen=WINDOW_STEPS)
        if options.capacity == "sps":
            self.survival_snapshots = StaleSnapshots(self.max_num_reqs, num_drafts, device)
        # k_r of the step being prepared, copied to the host for vLLM's statistics
        # (patches/admission_metrics.py); a few slots, as steps overlap.
        self.admitted_host = torch.zeros(
            (4, self.max_num_reqs), dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        self.pending_admission = None
        # varlen_verify=false: per batch row, the drafts the running step ran but does not
        # verify (hold_masked_drafts), until its sampling counts them rejected.
        self.masked_drafts = None
        # A hash of every compacted step's k_r in order: tensor-parallel ranks must agree.
        # Folded on the device as each step is prepared, on every rank: only one rank's
        # output ever reaches the scheduler (and its get_output), so a host-side fold there
        # would leave the other ranks at 0.
        self.fingerprint = torch.zeros((), dtype=torch.int64, device=device)
        # Distinct weights per batch row, so that k_r moved between rows changes the hash.
        weights = torch.arange(self.max_num_reqs, dtype=torch.int64) * 40503 % 65521 + 1
        self.fingerprint_weights = weights.to(device)
        self.drafts_proposed = 0  # in compacted steps, for the admitted share
        self.drafts_admitted = 0
        self.compacted_steps = 0
        self.graph_steps = 0  # compacted steps replayed from a FULL CUDA graph
        self.mixed_steps = 0  # compacted steps that also carried prompts (dspark_mixed_steps)
        self.all_drafts = torch.tensor(float(num_drafts))  # K, for full-admission records
        if self.controls_capacity:
            check_compaction_supported(vllm_config)

    # The runner patches' interface.

    def plan_step(self, step: StepFacts) -> StepPlan | None:
        """Before a step runs: what it verifies (None: vLLM's own step, every draft
        verified), noting what the step-time fit reads of it."""
        self.next_step_drafts = step.next_step_drafts
        self.timed_step = None
        if self.options.plain_steps and step.plain_decode:
            # Timed apart: the draft gate weighs drafting against this step's cost.
            self.timed_step = TimedStep(step.num_reqs, step.num_reqs, plain=True)
        plan = self._step_budget(step)
        if plan is not None and self.masked_step_drafts > 0:
            # The target runs every draft: what the step's forward costs.
            tokens = step.num_reqs * (1 + self.masked_step_drafts)
            self.timed_step = TimedStep(tokens, step.num_reqs)
            plan = StepPlan(plan.budget, masked=True)
        elif plan is not None and plan.mixed is None:
            # Timed apart from vLLM's own steps: the compaction premium (step_overhead.py).
            self.timed_step = dataclasses.replace(self.timed_step, compacted=True)
        return plan

    def _step_budget(self, step: StepFacts) -> StepPlan | None:
        """B for a step that can be compacted, else None (all K drafts are verified)."""
        if self.resting:
            # sps at rest (rest.py): vLLM's own step, its requests not sorted out.
            self.record_full_admission(step.num_drafting)
            return None
        decoding = step.count_decoding()
        if decoding is None:
            return None
        num_drafts = self.num_speculative_steps
        mixed = decoding < step.num_reqs
        budget = self.admission_budget(decoding, vary=not mixed)
        prompt_tokens = step.num_tokens - decoding * (1 + num_drafts)
        self.timed_step = TimedStep(decoding + budget + prompt_tokens, decoding, prompt_tokens)
        if budget == decoding * num_drafts:
            # Every draft admitted: compaction would be the identity. vLLM's own step (and
            # its uniform-decode graph) runs the same tokens with less host work.
            self.record_full_admission(decoding)
            return None
        if not mixed:
            return StepPlan(budget)
        dropped = decoding * num_drafts - budget
        return StepPlan(budget, mixed=(decoding, step.num_tokens - dropped))

    @property
    def splits_by_survival(self) -> bool:
        """Whether a step's budget goes to the requests' likeliest drafts (every mode but
        ``acceptance``, which verifies one depth for all): only then does the room a
        request has left before its max_tokens matter."""
        return self.acceptance is None

    def admit_step(
        self,
        req_ids: list[str],
        slots: torch.Tensor,
        budget: int,
        emit_room: torch.Tensor | None,
        from_graph: bool,
        mixed: bool,
    ) -> torch.Tensor:
        """k_r of each decoding request of a step verifying ``budget`` drafts (on the
        device), recorded for the metrics (``from_graph``: the step replays a FULL graph;
        ``mixed``: it also carries prompts)."""
        capacity = self.verify_capacity(slots, budget, emit_room)
        self.record_admission(req_ids, budget, from_graph, capacity, mixed)
        return capacity

    def hold_masked_drafts(self, dropped: torch.Tensor) -> None:
        """A masked step's drafts per batch row that it runs but does not verify, until
        its sampling counts them rejected (:meth:`take_masked_drafts`)."""
        self.masked_drafts = dropped

    def take_masked_drafts(self) -> torch.Tensor | None:
        masked, self.masked_drafts = self.masked_drafts, None
        return masked

    def take_step_report(self):
        """What the step's output tells the scheduler, once: (request ids, k_r on the host
        once its copies are done) of a compacted step, and the drafts the coming steps
        should schedule with plain steps (each None when there is nothing to tell)."""
        return self.take_admission(), self.take_gate_report()

    # The speculator's interface.

    def plan_proposal(self, input_batch, num_sampled: torch.Tensor) -> ProposalPlan:
        """Before a real proposal: take in what the step just run verified and how long
        it took, then decide whether the proposal drafts and how many positions it
        computes (``draft_depth``)."""
        num_reqs = input_batch.num_reqs
        drafting = self._rest_proposal(num_reqs)
        if drafting is not None:
            self.drafted_last = drafting
            return ProposalPlan(drafting, resting=True)
        self._observe_real_step(input_batch, num_sampled)
        self._use_depth(self.proposal_depth(num_reqs))
        drafting = self._plan_drafting(num_reqs, self.draft_depth)
        if drafting and self.slowest_request is not None:
            self.slowest_request.start(input_batch.req_ids, input_batch.idx_mapping_np)
        self.drafted_last = drafting
        return ProposalPlan(drafting, resting=False)

    def observe_proposal(self, slots: torch.Tensor, survival: torch.Tensor) -> None:
        """After a real proposal not at rest: its rows' prefix survivals [R, K], by
        request slot."""
        self.slot_survival[slots] = survival
        if self.drafted_last:
            self.record_proposal(survival, slots)

    def _plan_drafting(self, num_reqs: int, depth: int) -> bool:
        """Whether a proposal planned at ``depth`` drafts, at the shallower depth the draft
        gate chose where the planned one does not pay; counted by the depth it drafts at."""
        drafting = self._decide_drafting(num_reqs, depth)
        if drafting and self.gate_depth < depth:
            self._use_depth(self.gate_depth)
        if drafting:
            self.proposals_at_depth[self.draft_depth - 1] += 1
        return drafting

    def _use_depth(self, depth: int) -> None:
        if self.varies_depth:
            self.draft_depth = depth

    def set_draft_cost(self, rows_by_depth: dict[int, list[tuple[int, float]]]) -> None:
        """{depth: [(requests, ms)]} of one proposal, profiled at start-up per depth whose
        graphs exist: a step's time includes its proposal's, and it opens the draft gate."""
        self.profiled_draft_ms = rows_by_depth
        self.draft_tables = {
            depth: draft_seconds_table(rows, self.max_num_reqs)
            for depth, rows in rows_by_depth.items()
            if rows
        }
        if not self.gates_drafting or self.sps_table_host is None or not self.draft_tables:
            return
        self.draft_gate = DraftGate(
            self.sps_table_host,
            self.draft_tables,
            masked_step_drafts=self.masked_step_drafts,
            probe_burst=PLAIN_PROBE_BURST if self.options.plain_steps else 1,
        )
        if self.acceptance is not None:
            return  # the gate reads the acceptance observed per position
        # Recent prefix survival per position of the mean request, or (gate_objective=batch)
        # of the request drafting worst, for the gate (optimistic at first).
        self.stale_survival = StalePerRequest(self.device, [1.0] * self.num_speculative_steps)
        self.gate_survival = SurvivalAverage()
        if self.options.gate_objective == "batch":
            self.slowest_request = SlowestRequest(
                self.max_num_reqs, self.num_speculative_steps, self.device
            )

    @property
    def masked_step_drafts(self) -> int:
        """Drafts per request every speculative step runs through the target whatever it
        verifies: K when verified masked (``dspark_varlen_verify=false``), 0 when compacted
        to what it verifies."""
        return 0 if self.options.varlen_verify else self.num_speculative_steps

    @property
    def gates_drafting(self) -> bool:
        """Whether a draft gate decides to draft at all: with ``sps``, and with
        ``acceptance`` when it may schedule plain steps instead."""
        capacity = self.options.capacity
        return capacity == "sps" or (capacity == "acceptance" and self.options.plain_steps)

    def _decide_drafting(self, num_reqs: int, depth: int) -> bool:
        """Whether the coming proposal drafts: unless the draft gate closes, or (plain
        steps) the step it proposes for was scheduled without drafts."""
        gate_open = self._gate_open(num_reqs, depth)
        drafting = gate_open
        if self.options.plain_steps:
            # A gate measuring the costs it weighs (O known) times plain steps now and then.
            overhead = self.step_overhead
            if self.draft_gate is not None and overhead.measuring and overhead.ready:
                # Told also of a closed gate, whose plain steps measure its batch range.
                decided = self.draft_gate.beats_any_plain_step
                closes = self.plain_cost_probe.closes(num_reqs, gate_open, decided)
                gate_open = gate_open and not closes
            # An open verdict (a probe of the closed gate's too) holds until a step the
            # scheduler gave drafts takes it: the scheduler acts a step or two late.
            gate_open = gate_open or self.open_verdict_pending
            self.gate_report = self.num_speculative_steps if gate_open else 0
            drafting = gate_open and self.next_step_drafts != 0
            self.open_verdict_pending = gate_open and not drafting
        self.proposals_skipped += not drafting
        return drafting

    def _gate_open(self, num_reqs: int, depth: int) -> bool:
        """The draft gate's verdict; ``gate_depth``: the depth it drafts (a shallower one
        where only that pays)."""
        self.gate_depth = depth
        if self.draft_gate is None:
            return True
        overhead = self.step_overhead
        if not overhead.ready:
            return True  # not weighed before the step's costs are known
        plain = overhead.plain_step_seconds(num_reqs) if self.options.plain_steps else None
        if self.acceptance is not None:
            self._observe_acceptance()
            survival = self.acceptance.survival().tolist()
        else:
            survival = self.gate_survival.update(self.stale_survival, num_reqs)
        # A recent proposal of a large batch values drafting by slot, as sps admits; a
        # small one is too noisy a reading.
        by_slot = self.gate_snapshot
        if by_slot is not None and len(by_slot) < SURVIVAL_MEMORY:
            by_slot = None
        gate_open = self.draft_gate.decide(
            num_reqs,
            survival,
            depth,
            overhead_s=overhead.per_step_seconds(num_reqs),
            per_draft_s=overhead.per_draft_seconds,
            skip_s=overhead.skip_seconds,
            plain_s=plain,
            survival=by_slot,
            compaction_s=overhead.compaction_seconds,
        )
        self.gate_depth = self.draft_gate.depth_chosen
        return gate_open

    def take_gate_report(self) -> int | None:
        """plain_steps: the drafts the coming steps should schedule (K, or 0 while the
        gate is closed) for the scheduler (:mod:`plain_steps`), once."""
        report, self.gate_report = self.gate_report, None
        return report

    def set_sps_curve(self, curve: list, device: torch.device, profiled: bool = False) -> None:
        if profiled:
            self.profiled_sps_curve = curve
            self.needs_sps_profile = False
        max_tokens = self.max_num_reqs * (1 + self.num_speculative_steps)
        table = sps_table_from_curve(curve, max_tokens)
        self.sps_table_host = padded_to_graph_sizes(table, graph_sizes(self.vllm_config)).double()
        self.sps_table = self.sps_table_host.float().to(device)

    def _observe_real_step(self, input_batch, num_sampled: torch.Tensor) -> None:
        """At a real proposal: what the step that just ran verified, and its time."""
        self._observe_verification(input_batch, num_sampled)
        self._observe_step_time(input_batch.num_reqs)

    def _observe_verification(self, input_batch, num_sampled: torch.Tensor) -> None:
        """The step's verified and accepted drafts, per position for the acceptance
        controller and per request for :meth:`_observe_drafted`."""
        if not self._reads_verification:
            return
        verification = self.drafted_verification(input_batch, num_sampled)
        self.record_verification(verification.position_counts)
        self._observe_drafted(input_batch, verification.num_verified, verification.num_accepted)

    @property
    def _reads_verification(self) -> bool:
        """Whether anything reads what each step verified and accepted."""
        return self.acceptance is not None or self.verification_reader is not None

    def _observe_drafted(
        self, input_batch, num_verified: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """Per request of the step that just ran: its drafts verified and accepted, for
        the speculator's own reader."""
        if self.verification_reader is not None:
            self.verification_reader(input_batch.idx_mapping, num_verified, num_accepted)

    def drafted_verification(self, input_batch, num_sampled: torch.Tensor) -> Verification:
        """What the step that just ran verified and accepted, per request and per position,
        counting only drafts its proposal computed. A step vLLM verifies uncompacted (a
        prefill chunk in the batch, logprobs) verifies all K positions, also the
        placeholders of a proposal the draft gate skipped or of positions past its depth,
        which are no drafts: counted, they would read as rejections (an acceptance gate
        closed by them reopens only through its probes) and skew calibration and online
        STS. On a GPU one kernel computes it all (:mod:`verification_kernel`)."""
        depth, num_drafts = self.draft_depth if self.drafted_last else 0, self.num_speculative_steps
        cu_num_logits = input_batch.cu_num_logits
        if use_triton(num_sampled):
            return verification_stats(
                cu_num_logits, num_sampled, depth, num_drafts, self.max_num_reqs
            )
        return drafted_counts(cu_num_logits, num_sampled, depth, num_drafts)

    def _observe_step_time(self, num_reqs: int) -> None:
        """At a real proposal for ``num_reqs`` requests, for ``sps``: the step that just
        ran is one sample of the time outside the curve (:mod:`step_overhead`)."""
        if self.step_overhead is None or self.sps_table_host is None:
            return
        step, self.timed_step = self.timed_step, None
        if step is None:  # not a step the curve describes
            self.step_overhead.observe(None, 0.0, 0.0)
            return
        draft_s = 0.0 if step.plain else self._draft_seconds(num_reqs)
        skipped = not self.drafted_last and not step.plain
        self.step_overhead.observe(
            step.drafts,
            self._forward_seconds(step.tokens),
            draft_s,
            step.requests,
            skipped,
            step.plain,
            step.compacted,
        )

    def _forward_seconds(self, tokens: int) -> float:
        """The curve's forward for a step of ``tokens``; past the table (a step carrying
        prompts), at the table's last tokens per second, as the curve ends."""
        table = self.sps_table_host
        last = len(table) - 1
        if tokens <= last:
            return 1.0 / float(table[tokens])
        return tokens / (last * float(table[last]))

    def _draft_seconds(self, num_reqs: int) -> float:
        """The profiled time of the last proposal (0 when it was skipped)."""
        return self._proposal_seconds(num_reqs, self.draft_depth) if self.drafted_last else 0.0

    def _proposal_seconds(self, num_reqs: int, depth: int) -> float:
        """The profiled time of a proposal computing ``depth`` positions (0 unprofiled)."""
        if not self.draft_tables:
            return 0.0
        return proposal_seconds(self.draft_tables, min(num_reqs, self.max_num_reqs), depth)

    @property
    def resting(self) -> bool:
        """sps at rest (:mod:`vllm_dspark.capacity.rest`): steps verify every draft."""
        return self.rest is not None and self.rest.resting

    def _rest_proposal(self, num_reqs: int) -> bool | None:
        """At a real proposal: None when it does not rest, else whether it drafts (at full
        depth, without the controller's work: survivals, statistics, gate); plain steps:
        not for a step the scheduler gave no drafts."""
        rest = self.rest
        if rest is None or not rest.resting:
            return None
        if not rest.take_proposal(num_reqs, self.stale_budget.proposals):
            # Woken: the step just run is no sample of the step overhead (the clock ran
            # through the rest).
            self.timed_step = None
            return None
        drafting = not self.options.plain_steps or self.next_step_drafts != 0
        self.proposals_at_depth[self.draft_depth - 1] += drafting
        return drafting

    def _observe_rest(self, num_reqs: int, admits_all: bool) -> None:
        """sps, after reading a proposal's statistics: whether the controller may rest.
        Only at full depth, with the step costs fitted (or given) and no reader of every
        step's verification (calibration metrics, online STS)."""
        overhead = self.step_overhead
        wants_all = (
            admits_all
            and self.draft_depth == self.num_speculative_steps
            and (overhead is None or overhead.ready)
            and not self._reads_verification
        )
        self.rest.observe(wants_all, self.stale_budget.record_read, num_reqs)
        if self.rest.resting and self.options.plain_steps:
            self.gate_report = self.num_speculative_steps  # the scheduler drafts throughout

    def admission_budget(self, num_reqs: int, vary: bool = True) -> int:
        """How many drafts a step's ``num_reqs`` decoding requests verify (host-known);
        ``vary``: the step may be one that measures the per-draft time (not one that also
        carries prompts, whose time the step overhead leaves out)."""
        if not self.drafted_last:
            return 0  # the proposal being verified drafted nothing
        num_drafts = self.num_speculative_steps
        if self.resting:
            return num_reqs * num_drafts
        cap = admission_budget(num_reqs, num_drafts, self.options.budget_frac)
        if self.physical_depth is not None:
            # The drafts being verified were computed to the depth of the last proposal.
            cap = min(cap, num_reqs * self.draft_depth)
        measuring = vary and self.step_overhead is not None and self.step_overhead.measuring
        if self.acceptance is not None:
            # With dynamic depth the proposal computed the depth planned for this step.
            dynamic = self.options.dynamic_depth
            depth = self.draft_depth if dynamic else self._acceptance_depth(num_reqs)
            # Varied per request, so that every request still verifies the same depth.
            if measuring:
                hinges = functools.partial(self._depth_hinges_on_draft_time, num_reqs)
                depth = self._vary_admission(depth, num_reqs * depth, hinges)
            return num_reqs * depth
        if self.stale_budget is None:
            return cap
        wanted = round(self.stale_budget.per_request() * num_reqs)
        # At least one draft: a compacted step always has drafts to verify.
        budget = max(1, min(cap, wanted))
        full = num_reqs * num_drafts
        if self.rest is not None and vary:
            self._observe_rest(num_reqs, budget == full)
        if not measuring:
            return budget
        if self.options.capacity == "sps" and budget < cap == full and not self.masked_step_drafts:
            return self._vary_admission(budget, budget, full=full)
        return self._vary_admission(budget, budget)

    def _vary_admission(
        self,
        budget: int,
        drafts: int,
        worth_it: Callable[[], bool] | None = None,
        full: int | None = None,
    ) -> int:
        """sps or acceptance measuring its step overhead: one step in EXPLORE_EVERY of
        those verifying ``drafts`` >= EXPLORE_MIN_DRAFTS verifies the better half of its
        admission only (of its depth, for acceptance), unless ``worth_it`` (asked then
        only) says its reading could change no decision. Steps that all verify the same
        number of drafts (an admission that has settled) cannot tell the per-draft time
        from the per-step time (``step_overhead``); this step can, for the price of its
        less likely half of the drafts. ``full``: all R K drafts (sps, compacting): every
        other probe then verifies all of them, uncompacted, where the compaction premium
        could decide (:meth:`_compaction_could_decide`), so that C is measured against
        steps that were not compacted. A function of the step count, the step's drafts and host
        values every rank holds alike: lossless, and the same on every rank."""
        if drafts < EXPLORE_MIN_DRAFTS or budget < 2:
            return budget
        self.steps_since_varied += 1
        if self.steps_since_varied < EXPLORE_EVERY:
            return budget
        self.steps_since_varied = 0
        if worth_it is not None and not worth_it():
            return budget
        if full is not None:
            self.full_probe_next = not self.full_probe_next
            num_reqs = full // self.num_speculative_steps
            if self.full_probe_next and self._compaction_could_decide(num_reqs, budget):
                return full
        return budget // 2

    def _compaction_could_decide(self, num_reqs: int, budget: int) -> bool:
        """sps: whether verifying ``budget`` drafts compacted rather than all R K saves less
        time (forward and per-draft) than a compacted step's overhead O + a R + C (C a part
        of O until told apart): only then could C turn the admission to all. Never before
        the overhead is fitted."""
        overhead, table = self.step_overhead, self.sps_table_host
        full = num_reqs * self.num_speculative_steps
        if not overhead.ready or table is None or num_reqs + full >= len(table):
            return False
        forward_saved = 1.0 / float(table[num_reqs + full]) - 1.0 / float(table[num_reqs + budget])
        saved = forward_saved + overhead.per_draft_seconds * (full - budget)
        return saved < overhead.per_step_seconds(num_reqs) + overhead.compaction_seconds

    def verify_capacity(
        self, slots: torch.Tensor, budget: int, emit_room: torch.Tensor | None = None
    ) -> torch.Tensor:
        """k_r of each request: the same depth for all (acceptance), else the ``budget``
        best slots by proposal-time survival, where a request's slots past ``emit_room``
        (the drafts it can still emit before its max_tokens,
        :func:`vllm_dspark.verify.layout.emit_room`) come last:
        the budget goes to requests that can use it."""
        if self.acceptance is not None:
            return torch.full_like(slots, budget // len(slots), dtype=torch.int64)
        survival = self.slot_survival[slots]
        if emit_room is not None:
            positions = torch.arange(survival.shape[-1], device=survival.device)
            survival = survival.masked_fill(positions >= emit_room[:, None], UNCOMPUTED_SURVIVAL)
        return budget_capacity(survival, budget)

    def record_admission(
        self,
        req_ids: list[str],
        budget: int,
        from_graph: bool,
        capacity: torch.Tensor,
        mixed: bool = False,
    ) -> None:
        """After a compacted step's admission (``capacity``: k_r per decoding request;
        ``mixed``: the step also carried prompts)."""
        num_reqs = len(req_ids)
        self.drafts_proposed += num_reqs * self.num_speculative_steps
        self.drafts_admitted += budget
        self.compacted_steps += 1
        self.graph_steps += from_graph
        self.mixed_steps += mixed
        slot = self.admitted_host[self.compacted_steps % len(self.admitted_host), :num_reqs]
        slot.copy_(capacity, non_blocking=True)
        self.pending_admission = (req_ids, slot)
        self.fold_fingerprint(capacity)
        self.trace_step(num_reqs, budget)
        if self.physical_depth is not None and budget > 0:
            # (A step verifying a skipped proposal admits 0 because nothing was drafted:
            # counting it would sink the depth to 1 while the draft gate is closed, and
            # the gate, which weighs depths up to that one, would then stay closed.)
            max_admitted = round(self.stale_max_admitted.per_request())
            self.stale_max_admitted.record(capacity.max(), 1)
            self.physical_depth.observe(num_reqs, max_admitted, self._paying_depth)

    def record_full_admission(self, num_reqs: int) -> None:
        """After a decode step that admitted every draft: it runs vLLM's uniform layout
        uncompacted (the same tokens), so this bookkeeping stays on the host."""
        num_drafts = self.num_speculative_steps
        self.drafts_proposed += num_reqs * num_drafts
        self.drafts_admitted += num_reqs * num_drafts
        self.trace_step(num_reqs, num_reqs * num_drafts)
        if self.physical_depth is not None and not self.resting:
            max_admitted = round(self.stale_max_admitted.per_request())
            self.stale_max_admitted.record(self.all_drafts, 1)
            self.physical_depth.observe(num_reqs, max_admitted, self._paying_depth)

    def trace_step(self, num_reqs: int, budget: int) -> None:
        """While tracing: [requests, drafts admitted, depth the verified proposal
        computed, the step overhead's O (ms), a and b (us), C (ms)] of this decode step, so
        that a batch's record shows what each step decided and on what."""
        if self.step_trace is None:
            return
        fit = self.step_overhead
        costs = (0.0, 0.0, 0.0, 0.0)
        if fit is not None:
            per_request, per_draft = fit.per_request_seconds, fit.per_draft_seconds
            costs = (fit.seconds * 1e3, per_request * 1e6, per_draft * 1e6)
            costs += (fit.compaction_seconds * 1e3,)
        depth = self.draft_depth if budget else 0  # 0: the proposal was skipped
        self.step_trace.append([num_reqs, budget, depth, *(round(c, 3) for c in costs)])

    def fold_fingerprint(self, admitted: torch.Tensor) -> None:
        """h = (h * M + sum_r w_r k_r + R) mod 2^31 - 1, on the device (no host sync);
        every term stays within int64."""
        num_reqs = admitted.shape[0]
        step = (admitted.long() * self.fingerprint_weights[:num_reqs]).sum() + num_reqs
        self.fingerprint.mul_(_FINGERPRINT_MUL).add_(step).remainder_(_FINGERPRINT_MOD)

    @property
    def admission_fingerprint(self) -> int:
        return int(self.fingerprint.item())

    def take_admission(self):
        """The step's (request ids, k_r on the host once its copies are done), once."""
        pending, self.pending_admission = self.pending_admission, None
        return pending

    def record_verification(self, position_counts: torch.Tensor) -> None:
        """After a real step's verification: its (reached, accepted) counts per position
        (:attr:`Verification.position_counts`), for the acceptance controller."""
        if self.acceptance is None:
            return
        self.stale_position_counts.record(position_counts, 1)

    def record_proposal(self, survival: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """After a real proposal (``slots``: its rows' request slots): how many of its drafts
        threshold / sps want verified, and the survivals the draft gate reads. On a GPU one
        kernel computes both (:mod:`vllm_dspark.capacity.proposal_kernel`)."""
        if self.acceptance is not None or (self.draft_gate is None and self.stale_budget is None):
            return  # acceptance reads verified steps, not proposals
        sps = self.options.capacity == "sps"
        if sps and self.sps_table is None:
            # A warm-up step before sps_curve=auto is profiled (DeepSeek-V4's attention
            # warm-up runs whole steps before graph capture): nothing to weigh it by.
            return
        num_reqs = survival.shape[0]
        threshold = self.options.confidence_threshold
        fixed = per_draft = compaction = 0.0
        sps_table = None
        if sps:
            # The next step's time beyond its forward: O + a R, its proposal, b per draft,
            # C if compacted.
            fixed, per_draft, compaction = self.step_overhead.verification_costs(num_reqs)
            fixed += self._draft_seconds(num_reqs)
            sps_table = masked_forward_table(self.sps_table, num_reqs, self.masked_step_drafts)
        if use_triton(survival):
            stats = proposal_stats(
                survival,
                sps_table,
                fixed,
                per_draft,
                compaction,
                threshold,
                self.max_num_reqs,
            )
            sums = stats.position_sums
            wanted = stats.sps_count if sps else stats.threshold_count
        else:
            sums = survival.clamp(min=0).sum(dim=0)
            if sps:
                wanted = sps_best_count(survival, sps_table, fixed, per_draft, compaction)
            else:
                wanted = threshold_count(survival, threshold)
        if self.slowest_request is not None:
            self.stale_survival.record(self.slowest_request.reading(slots, survival), 1)
        elif self.draft_gate is not None:
            self.stale_survival.record(sums, num_reqs)
        if self.stale_budget is not None:
            self.stale_budget.record(wanted, num_reqs)
        # Read by the depth that pays and by a gate of the step objective; none else.
        gate_reads = self.draft_gate is not None and self.slowest_request is None
        depth_reads = self.physical_depth is not None
        if self.survival_snapshots is not None and (depth_reads or gate_reads):
            wanted = sum(self.snapshot_rows) < SURVIVAL_MEMORY
            self.snapshot_rows.append(num_reqs if wanted else 0)
            earlier = self.survival_snapshots.exchange(survival if wanted else None)
            if earlier is not None and gate_reads:
                self.gate_snapshot = earlier
            if earlier is not None and depth_reads:
                self.depth_snapshots.append(earlier)


def _tp_reduce_max():
    """In-place max over the tensor-parallel ranks of a device tensor (None: one rank)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return None

    def reduce_max(tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(
            tensor, op=torch.distributed.ReduceOp.MAX, group=group.device_group
        )

    return reduce_max
