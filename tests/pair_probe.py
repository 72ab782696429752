"""``tests/gpu/llm_probe.py`` on the embedded pair, the way the GPU tests run it."""

from __future__ import annotations

import json
from pathlib import Path

from subprocess_probe import run_probe, without_dspark_plugin

from vllm_dspark.demo import EMBEDDED_PAIR

LLM_PROBE = Path(__file__).parent / "gpu" / "llm_probe.py"


def pair_spec(options: dict | None, **spec) -> str:
    """The probe's JSON spec for the embedded pair: DSpark with ``options`` (None: no
    speculation). ``spec`` gives the probe's other keys (the prompts and max_tokens at
    least) and may override the defaults: float32, a tenth of the GPU's memory."""
    full = {
        "target": str(EMBEDDED_PAIR / "target"),
        "draft": None if options is None else str(EMBEDDED_PAIR / "draft"),
        "options": options or {},
        "dtype": "float32",
        "gpu_memory_utilization": 0.1,
        **spec,
    }
    return json.dumps(full)


def run_pair(options: dict | None, plugin: bool = True, timeout: int = 900, **spec) -> dict:
    """Greedy generation with the embedded pair (:func:`pair_spec`), with or without this
    plugin loaded."""
    plugins = None if plugin else without_dspark_plugin()
    return run_probe(LLM_PROBE, stdin=pair_spec(options, **spec), plugins=plugins, timeout=timeout)


def run_dummy(
    target: str, draft: str | None, options: dict | None, dtype: str = "float32", **spec
) -> dict:
    """``llm_probe.py`` on a dummy-weight pair in ``dtype`` (``draft`` unused without
    ``options``: no speculation; None with them: the drafter the target's checkpoint holds,
    DeepSeek-V4's DSpark module); ``spec`` gives prompts, max_tokens, max_num_seqs and the
    probe's other keys ("engine": further LLM() arguments)."""
    spec |= {
        "target": target,
        "draft": draft if options is not None else None,
        "draft_in_target": options is not None and draft is None,
        "options": options or {},
        "dummy": True,
        "dtype": dtype,
    }
    return run_probe(LLM_PROBE, stdin=json.dumps(spec))
