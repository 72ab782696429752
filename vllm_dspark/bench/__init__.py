"""Benchmark equipment that must run inside vLLM's processes, kept apart from the runtime.

Nothing in the runtime imports this package unless a benchmark option asks for it:
``dspark_synthetic_confidence`` (:mod:`.synthetic`, :mod:`.synthetic_acceptance`: dummy
weights accept drafts by confidences that mean something), and the driver-side calls of
:mod:`.engine_control` (switching a running engine's capacity options, tracing its steps),
and :mod:`.dummy_weights` (named as the worker extension of engines with dummy weights).
"""

DUMMY_WEIGHTS_EXTENSION = "vllm_dspark.bench.dummy_weights.DummyWeightsExtension"
