"""Verify only the drafts capacity control admits: compacted, or masked.

What: wraps four names of vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner``):
``GPUModelRunner.execute_model``, where the speculator's controller plans the step on the
host (:meth:`~vllm_dspark.capacity.controller.CapacityController.plan_step`);
``dispatch_cg_and_sync_dp``, which picks the CUDA graph from the step's token count (a
compacted decode step replays the smallest compact FULL graph that holds its R + B
tokens, :mod:`vllm_dspark.patches.compact_graphs`); ``GPUModelRunner.prepare_inputs``,
after which the stock batch is rewritten on the GPU to the planned layout
(:mod:`vllm_dspark.verify.layout`); and ``GPUModelRunner.sample``, whose sampling counts
a masked step's unverified drafts as rejected. Steps with structured output or logprobs,
and steps that admit every draft, run unchanged.
Why: vLLM 0.26.0 verifies every scheduled draft; under load the verification of
drafts that will be rejected costs more than speculation gains.
Upstream: vllm-project/vllm#47808 (adaptive verification) does this in-tree, in vLLM
releases after 0.26.0.
Remove when: the pinned vLLM verifies a device-chosen subset of drafts itself.
Applied lazily, by :mod:`vllm_dspark.patches.speculator_selection`, only when a
speculator with capacity control is built; runners without one are untouched. Applies
:mod:`~vllm_dspark.patches.compact_graphs` with it; :mod:`~vllm_dspark.patches.dsv4_compact`
(DeepSeek-V4's host layout) goes in beside it and reads the plan through
:func:`compacting_plan`.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar

from vllm.config.compilation import CUDAGraphMode

from vllm_dspark.capacity.controller import StepPlan
from vllm_dspark.patches import compact_graphs
from vllm_dspark.patches.wrapping import ORIGINAL_ATTR, wrap
from vllm_dspark.verify.compact_graphs import pick_compact_graph
from vllm_dspark.verify.layout import compact_input_batch, masked_input_batch, step_facts

RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
# The plan of the step ``execute_model`` is running, if it verifies fewer than all drafts.
_step_plan_var: ContextVar[StepPlan | None] = ContextVar("vllm_dspark_step_plan", default=None)


def compacting_plan() -> StepPlan | None:
    """The plan of the step running now if its batch is compacted (not masked)."""
    plan = _step_plan_var.get()
    return None if plan is None or plan.masked else plan


def _controller(runner):
    controller = getattr(runner.speculator, "controller", None)
    return controller if controller is not None and controller.controls_capacity else None


def _make_execute_wrapper(execute_model):
    def execute_model_with_plan(self, scheduler_output, *args, **kwargs):
        controller = _controller(self)
        if controller is None or kwargs.get("dummy_run"):
            return execute_model(self, scheduler_output, *args, **kwargs)
        token = _step_plan_var.set(controller.plan_step(step_facts(self, scheduler_output)))
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            _step_plan_var.reset(token)

    return execute_model_with_plan


def _make_dispatch_wrapper(dispatch):
    def dispatch_with_compaction(manager, num_reqs, num_tokens, uniform_token_count, *args, **kw):
        plan = _step_plan_var.get()
        if plan is None or plan.masked:
            return dispatch(manager, num_reqs, num_tokens, uniform_token_count, *args, **kw)
        if plan.mixed is not None:  # prompts too: vLLM's mixed-batch dispatch, fewer tokens
            return dispatch(manager, num_reqs, plan.mixed[1], None, *args, **kw)
        num_tokens = num_reqs + plan.budget
        if not kw.get("need_eager") and not kw.get("num_active_loras"):
            compact = getattr(manager, compact_graphs.COMPACT_GRAPHS_ATTR, ())
            graph = pick_compact_graph(compact, manager.graphs, num_reqs, num_tokens)
            if graph is not None:
                return graph, None  # captured only without data parallelism: no DP sync
        # Mixed-length queries: no uniform-decode graph applies.
        return dispatch(manager, num_reqs, num_tokens, None, *args, **kw)

    return dispatch_with_compaction


def _make_prepare_wrapper(prepare_inputs):
    def prepare_inputs_with_plan(self, scheduler_output, batch_desc):
        batch = prepare_inputs(self, scheduler_output, batch_desc)
        plan = _step_plan_var.get()
        if plan is None:
            return batch
        from_graph = batch_desc.cg_mode == CUDAGraphMode.FULL
        layout = masked_input_batch if plan.masked else compact_input_batch
        return layout(self, batch, plan, from_graph)

    return prepare_inputs_with_plan


def _make_sample_wrapper(sample):
    def sample_with_masked_drafts(self, *args, **kwargs):
        sampler_output, num_sampled, num_rejected = sample(self, *args, **kwargs)
        controller = _controller(self)
        masked = controller.take_masked_drafts() if controller is not None else None
        if masked is None:
            return sampler_output, num_sampled, num_rejected
        # The drafts a masked step ran but did not verify count as rejected: the request's
        # computed tokens and the drafter's context end at its last accepted draft.
        return sampler_output, num_sampled, num_rejected + masked.to(num_rejected.dtype)

    return sample_with_masked_drafts


def is_applied() -> bool:
    runner_module = sys.modules.get(RUNNER_MODULE)
    return runner_module is not None and hasattr(
        runner_module.GPUModelRunner.execute_model, ORIGINAL_ATTR
    )


def apply() -> None:
    runner_module = sys.modules[RUNNER_MODULE]
    runner = runner_module.GPUModelRunner
    wrap(runner, "execute_model", _make_execute_wrapper)
    wrap(runner_module, "dispatch_cg_and_sync_dp", _make_dispatch_wrapper)
    wrap(runner, "prepare_inputs", _make_prepare_wrapper)
    wrap(runner, "sample", _make_sample_wrapper)
    compact_graphs.apply()
