"""Benchmark equipment that must run inside vLLM's processes, kept apart from the runtime.

Nothing in the runtime imports this package unless a benchmark option asks for it:
``dspark_synthetic_confidence`` (:mod:`.synthetic`, :mod:`.synthetic_acceptance`: dummy
weights accept drafts by confidences that mean something), and the driver-side calls of
:mod:`.engine_control` (switching a running engine's capacity options, tracing its steps).
"""
