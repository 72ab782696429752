"""Switch a running engine's capacity options from the driver (benchmarks, experiments).

Comparing capacity arms in one engine keeps everything else equal (memory layout, graphs,
caches) and saves an engine start per arm. The engine must have been started with what
the arms need: a capacity mode, ``dspark_dynamic_depth`` for arms that use it, and
``dspark_capacity=sps`` for ``sps`` with ``auto``. Calls into the workers, so it needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine starts.
"""

from __future__ import annotations


def _worker_switch(worker, updates: dict) -> dict:
    return worker.model_runner.speculator.switch_capacity(updates).non_default()


def switch_capacity(llm, **updates) -> dict:
    """Switch every rank (``updates``: option names without the ``dspark_`` prefix);
    returns the options now in force, as the first rank reports them."""
    return llm.collective_rpc(_worker_switch, args=(updates,))[0]


def _worker_trace(worker, tracing: bool) -> list[list] | None:
    speculator = worker.model_runner.speculator
    if not hasattr(speculator, "trace_step"):
        return None  # vLLM's own speculator (no option set): no capacity control to trace
    trace, speculator.step_trace = speculator.step_trace, [] if tracing else None
    return trace


def trace_steps(llm, tracing: bool) -> list[list] | None:
    """Start (``tracing``) or stop tracing every rank's decode steps
    (:meth:`~vllm_dspark.capacity.control.CapacityControl.trace_step`); stopping returns
    the first rank's trace."""
    return llm.collective_rpc(_worker_trace, args=(tracing,))[0]
