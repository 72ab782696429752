"""vLLM's spec-decode counters, read offline through ``LLM.get_metrics()``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PREFIX = "vllm:spec_decode_"


@dataclass
class SpecDecodeCounts:
    """Cumulative spec-decode counters; subtract two snapshots to measure a run."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, metrics) -> SpecDecodeCounts:
        counts = cls()
        for metric in metrics:
            if metric.name == PREFIX + "num_drafts":
                counts.drafts += metric.value
            elif metric.name == PREFIX + "num_draft_tokens":
                counts.draft_tokens += metric.value
            elif metric.name == PREFIX + "num_accepted_tokens":
                counts.accepted_tokens += metric.value
            elif metric.name == PREFIX + "num_accepted_tokens_per_pos":
                values = metric.values
                pad = len(values) - len(counts.accepted_per_position)
                counts.accepted_per_position += [0] * max(pad, 0)
                for i, value in enumerate(values):
                    counts.accepted_per_position[i] += value
        return counts

    def _combine(self, other: SpecDecodeCounts, sign: int, width: int) -> SpecDecodeCounts:
        def at(counts: SpecDecodeCounts, i: int) -> int:
            positions = counts.accepted_per_position
            return positions[i] if i < len(positions) else 0

        return SpecDecodeCounts(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted_tokens + sign * other.accepted_tokens,
            [at(self, i) + sign * at(other, i) for i in range(width)],
        )

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return self._combine(other, -1, len(self.accepted_per_position))

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        return self._combine(other, 1, width)

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step, the bonus token included."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafts whose position k was accepted (unconditional)."""
        return [
            a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_position
        ]


ITERATION_TOKENS = "vllm:iteration_tokens_total"  # observed once per engine step
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"  # once per request


def histogram_totals(metrics, name: str) -> tuple[int, float]:
    """(observations, their sum) of one of vLLM's histograms, over every engine. With every
    request submitted at once, the engine steps of a batch (ITERATION_TOKENS) are as many as
    its slowest request needs, however fast the others finished."""
    found = [metric for metric in metrics if metric.name == name]
    return sum(metric.count for metric in found), sum(metric.sum for metric in found)


def _worker_calibration(worker) -> dict:
    from dataclasses import asdict

    stats = getattr(worker.model_runner.speculator, "calibration", None)
    if stats is None:
        raise RuntimeError("dspark_confidence_metrics is off for this engine")
    return {name: asdict(value) for name, value in stats.summary().items()}


def confidence_calibration(llm) -> dict:
    """Per-position ECE and AUROC of the confidence head, as served so far.

    Needs ``dspark_confidence_metrics`` and, since it calls into the worker,
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set before the engine starts. Tensor-parallel
    ranks hold identical counts; the first rank's are returned.
    """
    return llm.collective_rpc(_worker_calibration)[0]


@dataclass
class AdmissionCounts:
    """Drafts proposed and admitted in compacted (capacity-controlled) decode steps."""

    proposed: int = 0
    admitted: int = 0
    num_drafts: int = 0  # K
    steps: int = 0
    graph_steps: int = 0  # of those steps, replayed from a FULL CUDA graph
    mixed_steps: int = 0  # of those steps, ones that also carried prompts
    depth: int = 0  # sequential positions the drafter computes now (a gauge)
    depth_changes: int = 0  # changes of the depth drafted (dynamic depth) or verified
    proposals_skipped: int = 0  # by the draft gate (sps with profiled costs)
    proposals_rested: int = 0  # sps at rest: drafted without the controller's work
    fingerprint: int = 0  # hash of every compacted step's admissions (ranks must agree)
    # sps: the step's time outside the SPS curve now (gauges, capacity/step_overhead.py)
    step_overhead_ms: float = 0.0
    per_request_overhead_us: float = 0.0
    per_draft_overhead_us: float = 0.0
    skipped_proposal_ms: float = 0.0  # what a proposal the draft gate skips still costs
    compaction_ms: float = 0.0  # what compacting a step costs beyond vLLM's own step (C)
    plain_step_ms: float = 0.0  # plain_steps: a plain step's time outside the curve (P)
    plain_per_request_us: float = 0.0  # and per request (p)
    proposals_at_depth: list[int] = field(default_factory=list)  # drafting ones, depth 1..K

    # Counts accumulate; the other fields are gauges (their value now).
    COUNTED = (
        "proposed",
        "admitted",
        "steps",
        "graph_steps",
        "mixed_steps",
        "depth_changes",
        "proposals_skipped",
        "proposals_rested",
    )

    def _combine(self, other: AdmissionCounts, sign: int) -> AdmissionCounts:
        counts = {name: getattr(self, name) + sign * getattr(other, name) for name in self.COUNTED}
        at_depth = zip(self.proposals_at_depth, other.proposals_at_depth, strict=True)
        return replace(self, **counts, proposals_at_depth=[a + sign * b for a, b in at_depth])

    def __sub__(self, other: AdmissionCounts) -> AdmissionCounts:
        """What was counted since ``other`` (an earlier snapshot), with this one's gauges."""
        return self._combine(other, -1)

    def __add__(self, other: AdmissionCounts) -> AdmissionCounts:
        """Two runs' counts together (e.g. arms whose repeats were interleaved), with the
        later run's (``other``'s) gauges."""
        return other._combine(self, 1)

    @property
    def admitted_per_request(self) -> float:
        """Mean drafts a request verified per compacted step (K when none were compacted)."""
        requests = self.proposed / self.num_drafts if self.num_drafts else 0
        return self.admitted / requests if requests else float(self.num_drafts)


def _worker_admission(worker) -> dict:
    speculator = worker.model_runner.speculator
    # vLLM's own speculator (no option set) has no controller: nothing counted apart.
    controller = getattr(speculator, "controller", speculator)
    return {
        "proposed": getattr(controller, "drafts_proposed", 0),
        "admitted": getattr(controller, "drafts_admitted", 0),
        "num_drafts": speculator.num_speculative_steps,
        "steps": getattr(controller, "compacted_steps", 0),
        "graph_steps": getattr(controller, "graph_steps", 0),
        "mixed_steps": getattr(controller, "mixed_steps", 0),
        "depth": getattr(controller, "draft_depth", speculator.num_speculative_steps),
        "depth_changes": getattr(controller, "depth_changes", 0),
        "proposals_skipped": getattr(controller, "proposals_skipped", 0),
        "proposals_rested": getattr(getattr(controller, "rest", None), "proposals_rested", 0),
        "fingerprint": getattr(controller, "admission_fingerprint", 0),
        **_overhead(getattr(controller, "step_overhead", None)),
        "proposals_at_depth": list(getattr(controller, "proposals_at_depth", [])),
    }


def _overhead(step_overhead) -> dict:
    if step_overhead is None:
        return {}
    return {
        "step_overhead_ms": round(step_overhead.seconds * 1e3, 4),
        "per_request_overhead_us": round(step_overhead.per_request_seconds * 1e6, 3),
        "per_draft_overhead_us": round(step_overhead.per_draft_seconds * 1e6, 3),
        "skipped_proposal_ms": round(step_overhead.skip_seconds * 1e3, 4),
        "compaction_ms": round(step_overhead.compaction_seconds * 1e3, 4),
        "plain_step_ms": round(step_overhead.plain_seconds * 1e3, 4),
        "plain_per_request_us": round(step_overhead.plain_per_request_seconds * 1e6, 3),
    }


def admission_counts(llm) -> AdmissionCounts:
    """The first rank's admission counters (ranks admit alike); needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine starts, as it calls into the
    worker."""
    return admission_counts_per_rank(llm)[0]


def admission_counts_per_rank(llm) -> list[AdmissionCounts]:
    """Every rank's admission counters (tensor parallelism: they must be identical)."""
    return [AdmissionCounts(**counts) for counts in llm.collective_rpc(_worker_admission)]


class ServedCounters:
    """Mixed into vLLM's workers (``--worker-extension-cls
    vllm_dspark.metrics.ServedCounters``): the plugin's counters by method name, for a
    served engine through vLLM's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``),
    e.g. ``{"method": "dspark_admission_counts"}``; one JSON object per rank."""

    def dspark_admission_counts(self) -> dict:
        """:class:`AdmissionCounts` as a dict (subtract two readings to measure a run)."""
        return _worker_admission(self)

    def dspark_gate_inputs(self) -> dict:
        """What the draft gate weighs now (:func:`gate_inputs`)."""
        return _worker_gate_inputs(self)


def _worker_gate_inputs(worker) -> dict:
    controller = getattr(worker.model_runner.speculator, "controller", None)
    gate = getattr(controller, "draft_gate", None)
    if gate is None:
        return {}
    if controller.acceptance is not None:  # the acceptance verified per position
        survival = controller.acceptance.survival().tolist()
    else:
        survival = controller.gate_survival.mean or controller.stale_survival.per_request()
    curve = controller.profiled_sps_curve or []
    return {
        "gate_open": gate.drafting,
        "skipped_in_a_row": gate.skipped_in_a_row,
        # plain steps: an open verdict waiting for a step the scheduler gave drafts, and
        # the drafts the scheduler gave the step after the last one (0: a plain step).
        "open_verdict_pending": controller.open_verdict_pending,
        "next_step_drafts": controller.next_step_drafts,
        "mean_survival": [round(s, 4) for s in survival],
        "sps_curve": [[int(t), sps] for t, sps in curve],
        "draft_ms": {
            depth: [[reqs, round(ms, 4)] for reqs, ms in rows]
            for depth, rows in controller.profiled_draft_ms.items()
        },
    }


def gate_inputs(llm) -> dict:
    """What the draft gate weighs now, on the first rank: whether it is open (and its
    proposals skipped in a row), the recent prefix survival per position it weighs
    (``mean_survival``: sps's mean request's, or with ``gate_objective=batch`` the worst
    request's; acceptance's verified survival), the profiled SPS curve [T, steps/s] and
    proposal times {depth: [R, ms]} (empty when no gate runs). Needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine starts."""
    return llm.collective_rpc(_worker_gate_inputs)[0]
