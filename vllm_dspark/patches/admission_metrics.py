"""Count the drafts capacity control admitted in vLLM's own spec-decode metrics.

What: wraps ``Scheduler.update_from_output`` of ``vllm.v1.core.sched.scheduler`` (engine
core, installed when the plugin loads) and, once a speculator with capacity control is
built, ``GPUModelRunner.sample_tokens`` of ``vllm.v1.worker.gpu.model_runner`` (worker).
In a compacted step the worker copies each request's admitted count k_r to pinned host
memory on the main stream, ahead of vLLM's own output copy (so the output's existing wait
covers it: no added synchronisation), and the step's output carries {request: K - k_r}.
The scheduler adds these to ``num_invalid_spec_tokens``, the per-request count of
scheduled drafts that vLLM's statistics leave out (it already does so for drafts a
grammar rejects; compaction never runs with structured output). Then, under vLLM's own
names: ``vllm:spec_decode_num_draft_tokens`` (and its per-position counts) counts the
drafts the target verified; drafts proposed = K x ``vllm:spec_decode_num_drafts``; mean
admitted per request = num_draft_tokens / num_drafts; accepted per position unchanged.
Outputs of uncompacted steps carry nothing, and both wrappers then pass through.
The same channel carries the draft gate's verdict for ``dspark_plain_steps`` (the drafts
the coming steps should schedule), which the scheduler applies
(:mod:`vllm_dspark.capacity.plain_steps`).
Why: vLLM 0.26.0 counts every scheduled draft as verified, and has no way for a worker to
tell the scheduler how many drafts to schedule.
Upstream: none; vllm-project/vllm#47808 (adaptive verification) reports verified drafts.
Remove when: the pinned vLLM verifies a device-chosen subset of drafts and counts it, and
lets the speculator choose the next step's draft count.
"""

from __future__ import annotations

import sys

from vllm_dspark.capacity import plain_steps
from vllm_dspark.patches.wrapping import wrap

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
# The attributes a step's ModelRunnerOutput carries: {request id: drafts not verified},
# and the drafts the gate wants scheduled (K or 0).
NOT_ADMITTED_ATTR = "dspark_not_admitted"
GATE_ATTR = "dspark_gate_drafts"


def attach_not_admitted(output, pending, num_drafts: int):
    """Once the step's host copies are done: {request: K - k_r} onto its output."""
    req_ids, admitted = pending
    not_admitted = {
        req_id: num_drafts - k
        for req_id, k in zip(req_ids, admitted.tolist(), strict=True)
        if k < num_drafts
    }
    setattr(output, NOT_ADMITTED_ATTR, not_admitted)
    return output


def _make_sample_tokens_wrapper(sample_tokens):
    def sample_tokens_with_admission(self, *args, **kwargs):
        output = sample_tokens(self, *args, **kwargs)
        controller = getattr(self.speculator, "controller", None)
        if controller is None:
            return output
        pending, gate = controller.take_step_report()
        if (pending is None and gate is None) or not hasattr(output, "get_output"):
            return output
        get_output = output.get_output
        num_drafts = controller.num_speculative_steps

        def get_output_with_admission():
            result = get_output()
            if gate is not None:
                setattr(result, GATE_ATTR, gate)
            if pending is None:
                return result
            return attach_not_admitted(result, pending, num_drafts)

        output.get_output = get_output_with_admission
        return output

    return sample_tokens_with_admission


def _make_update_wrapper(update_from_output):
    def update_from_output_with_admission(self, scheduler_output, model_runner_output):
        not_admitted = getattr(model_runner_output, NOT_ADMITTED_ATTR, None)
        if not_admitted:
            merged = dict(scheduler_output.num_invalid_spec_tokens or {})
            for req_id, count in not_admitted.items():
                merged[req_id] = merged.get(req_id, 0) + count
            scheduler_output.num_invalid_spec_tokens = merged
        gate = getattr(model_runner_output, GATE_ATTR, None)
        if gate is not None:
            plain_steps.schedule_next(self, gate)
        return update_from_output(self, scheduler_output, model_runner_output)

    return update_from_output_with_admission


def apply() -> None:
    """The scheduler side, in every process that loads the plugin (inert until a worker
    reports admissions)."""
    import vllm.v1.core.sched.scheduler  # noqa: F401

    wrap(sys.modules[SCHEDULER_MODULE].Scheduler, "update_from_output", _make_update_wrapper)


def apply_to_runner() -> None:
    """The worker side, once a speculator with capacity control is built."""
    runner = sys.modules[RUNNER_MODULE].GPUModelRunner
    wrap(runner, "sample_tokens", _make_sample_tokens_wrapper)
