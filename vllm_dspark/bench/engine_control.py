"""Switch a running engine's capacity options, and trace its steps, from the driver.

Comparing capacity arms in one engine keeps everything else equal (memory layout, graphs,
caches) and saves an engine start per arm. The engine must have been started with what
the arms need: a capacity mode, ``dspark_dynamic_depth`` for arms that use it, and
``dspark_capacity=sps`` for ``sps`` with ``auto``. Calls into the workers, so it needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine starts.
"""

from __future__ import annotations

from pydantic import ValidationError

from vllm_dspark.capacity.controller import CapacityController
from vllm_dspark.config import DSparkOptionError, DSparkOptions

# Options a running engine can switch; what they need was set up at start-up: compaction
# hooks, depth graphs, the SPS profile. confidence_metrics records the head's calibration
# afresh while on (the demo's untimed pass), and stops with any switch that leaves it out.
SWITCHABLE = frozenset(
    {
        "capacity",
        "budget_frac",
        "confidence_threshold",
        "sps_curve",
        "step_overhead_ms",
        "dynamic_depth",
        "varlen_verify",
        "mixed_steps",
        "plain_steps",
        "gate_objective",
        "confidence_metrics",
    }
)


def switch_speculator(speculator, updates: dict) -> DSparkOptions:
    """Give ``speculator`` a new controller for its options with ``updates`` (keys of
    ``SWITCHABLE`` without the prefix), keeping the measured costs and profiles; the
    counters restart. Refuses what start-up did not prepare."""
    from vllm_dspark.patches import compact_verification

    unknown = sorted(set(updates) - SWITCHABLE)
    if unknown:
        raise DSparkOptionError(
            f"vllm-dspark: cannot switch {unknown} in a running engine; "
            f"switchable: {sorted(SWITCHABLE)}."
        )
    kept = {k: v for k, v in speculator.options.non_default().items() if k not in SWITCHABLE}
    try:
        options = DSparkOptions.model_validate(kept | updates)
    except ValidationError as error:
        raise DSparkOptionError(f"vllm-dspark: {error}") from error
    previous = speculator.controller
    depth_graphs = bool(getattr(speculator, "_depth_graphs", None))
    missing = []
    if options.capacity != "off" and not compact_verification.is_applied():
        missing.append("capacity control (start with a dspark_capacity mode)")
    if options.dynamic_depth and not depth_graphs:
        missing.append("per-depth draft graphs (start with dspark_dynamic_depth)")
    auto_sps = options.capacity == "sps" and options.sps_curve == "auto"
    if auto_sps and previous.profiled_sps_curve is None:
        missing.append("an SPS profile (start with dspark_capacity=sps)")
    if options.confidence_metrics and not getattr(speculator, "has_confidence", False):
        missing.append("a confidence head (DSpark's, with a capacity mode)")
    if missing:
        raise DSparkOptionError(f"vllm-dspark: this engine was started without {missing}.")
    speculator.options = options
    speculator.controller = CapacityController(
        speculator.vllm_config,
        speculator.device,
        options,
        speculator.num_speculative_steps,
        speculator.max_num_reqs,
        previous,
    )
    if depth_graphs:
        speculator._use_depth(speculator.num_speculative_steps)
    if hasattr(speculator, "record_calibration"):
        speculator.record_calibration(options.confidence_metrics)
    return options


def _worker_switch(worker, updates: dict) -> dict:
    return switch_speculator(worker.model_runner.speculator, updates).non_default()


def switch_capacity(llm, **updates) -> dict:
    """Switch every rank (``updates``: option names without the ``dspark_`` prefix);
    returns the options now in force, as the first rank reports them."""
    return llm.collective_rpc(_worker_switch, args=(updates,))[0]


def _worker_trace(worker, tracing: bool) -> list[list] | None:
    controller = getattr(worker.model_runner.speculator, "controller", None)
    if controller is None:
        return None  # vLLM's own speculator (no option set): no capacity control to trace
    trace, controller.step_trace = controller.step_trace, [] if tracing else None
    return trace


def trace_steps(llm, tracing: bool) -> list[list] | None:
    """Start (``tracing``) or stop tracing every rank's decode steps
    (:meth:`~vllm_dspark.capacity.controller.CapacityController.trace_step`); stopping
    returns the first rank's trace."""
    return llm.collective_rpc(_worker_trace, args=(tracing,))[0]
