"""Profile the target's SPS curve at start-up for ``dspark_sps_curve=auto``.

What: wraps ``GPUModelRunner.capture_model`` of ``vllm.v1.worker.gpu.model_runner``: once
vLLM has captured the target's CUDA graphs, the runner times a decode step for every
captured FULL decode graph and a few larger decode steps, which run without a graph
(:mod:`vllm_dspark.capacity.sps_profile`; while it times them, vLLM's dummy batches carry
random token ids rather than zeros, so that MoE layers route them as they route decode
steps), takes the slowest rank's time per point under tensor parallelism (so every rank
admits alike) and hands the curve to the speculator's ``sps`` or ``acceptance`` capacity
mode; then times the speculator's captured draft graphs per batch size (and per depth,
with dynamic depth) the same way: both modes count a proposal's time in a step's, and the
draft gate (:mod:`vllm_dspark.capacity.draft_gate`) weighs it. A few seconds of start-up.
Why: the ``sps`` and ``acceptance`` modes need the target's steps per second against
tokens per step on this GPU; vLLM 0.26.0 has no hook after graph capture a plugin could use.
Upstream: none; vLLM's Dynamic SD takes a hand-written batch-size table instead.
Remove when: vLLM offers a post-capture hook to workers or profiles step costs itself.
Applied lazily, by :mod:`vllm_dspark.patches.speculator_selection`, only when a speculator
asks for the profile.
"""

from __future__ import annotations

import sys

import torch
from vllm.logger import init_logger

from vllm_dspark.capacity.sps_profile import (
    curve_from_times,
    time_draft_graphs,
    time_target_steps,
)
from vllm_dspark.config import KEY_PREFIX, DSparkOptionError
from vllm_dspark.patches.wrapping import wrap

logger = init_logger(__name__)
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def slowest_rank(rows: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Each point's time as the slowest tensor-parallel rank measured it."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1 or not rows:
        return rows
    times = torch.tensor([ms for _, ms in rows], dtype=torch.float64, device=group.device)
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX, group=group.device_group)
    return [(tokens, ms) for (tokens, _), ms in zip(rows, times.tolist(), strict=True)]


def _make_wrapper(capture_model):
    def capture_model_and_profile(self, *args, **kwargs):
        result = capture_model(self, *args, **kwargs)
        speculator = self.speculator
        controller = getattr(speculator, "controller", None)
        if controller is not None and controller.needs_sps_profile:
            rows = slowest_rank(time_target_steps(self))
            if not rows:
                raise DSparkOptionError(
                    f"vllm-dspark: {KEY_PREFIX}sps_curve='auto' found no FULL decode CUDA "
                    "graph of the target to time. Valid here: a curve."
                )
            curve = curve_from_times(rows)
            controller.set_sps_curve(curve, self.device, profiled=True)
            logger.info("vllm-dspark: SPS curve profiled at start-up [T, steps/s]: %s", curve)
            draft_ms = {
                depth: slowest_rank(time_draft_graphs(speculator, manager))
                for depth, manager in speculator.draft_graph_managers().items()
            }
            controller.set_draft_cost(draft_ms)
            logger.info("vllm-dspark: draft ms per proposal {depth: [R, ms]}: %s", draft_ms)
        return result

    return capture_model_and_profile


def apply() -> None:
    wrap(sys.modules[RUNNER_MODULE].GPUModelRunner, "capture_model", _make_wrapper)
