"""Every change vllm-dspark makes to vLLM's behaviour, and where and when it applies.

Each patch module's docstring says what it wraps, why, the upstream issue or PR, and
when it can go; each exposes an idempotent ``apply()`` (:mod:`.wrapping`). A patch
changes nothing while no vllm-dspark option is set. ``PATCHES`` lists them all: the
eager ones are applied in every process that loads the plugin (:func:`apply_all`), the
lazy ones by :mod:`.speculator_selection` in a worker once a speculator that needs them
is built, or (dummy weights) by a benchmark naming a worker extension.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Patch:
    module: str  # the module that applies it
    process: str  # where it runs: "api server / engine" (config), "engine core", "worker"
    eager: bool  # applied when the plugin loads; else once a speculator asks for it
    summary: str


PATCHES = (
    Patch(
        "vllm_dspark.patches.speculative_options",
        "api server / engine",
        True,
        "takes dspark_* keys out of the speculative config and validates them",
    ),
    Patch(
        "vllm_dspark.patches.speculator_selection",
        "worker",
        True,
        "builds the plugin's DSpark / DFlash speculator when an option is set",
    ),
    Patch(
        "vllm_dspark.patches.admission_metrics",
        "engine core (scheduler); worker once capacity control is on",
        True,
        "counts admitted drafts in vLLM's metrics; carries the draft gate's verdict",
    ),
    Patch(
        "vllm_dspark.patches.compact_verification",
        "worker",
        False,
        "plans each step with the capacity controller; verifies admitted drafts only",
    ),
    Patch(
        "vllm_dspark.patches.compact_graphs",
        "worker",
        False,
        "captures FULL variable-length CUDA graphs for compacted steps",
    ),
    Patch(
        "vllm_dspark.patches.dsv4_compact",
        "worker",
        False,
        "gives DeepSeek-V4's attention builders a compacted step's host and device layout",
    ),
    Patch(
        "vllm_dspark.patches.dsv4_breakable_attention",
        "worker",
        False,
        "runs DeepSeek-V4's attention between PIECEWISE graph segments, as vLLM intends",
    ),
    Patch(
        "vllm_dspark.patches.sps_autoprofile",
        "worker",
        False,
        "profiles the target's SPS curve and the drafter's time after graph capture",
    ),
    Patch(
        "vllm_dspark.bench.synthetic_acceptance",
        "worker",
        False,
        "benchmarks only: accepts drafts by calibrated synthetic confidence",
    ),
    Patch(
        "vllm_dspark.bench.dummy_weights",
        "worker",
        False,
        "benchmarks only: finishes a dummy DeepSeek-V4 target's weights (worker extension)",
    ),
    Patch(
        "vllm_dspark.bench.parallel_warmup",
        "worker",
        False,
        "benchmarks only: compiles DeepGEMM's warmup kernels in parallel processes",
    ),
)


def apply_all() -> None:
    """The eager patches (every process that loads the plugin)."""
    for patch in PATCHES:
        if patch.eager:
            importlib.import_module(patch.module).apply()
