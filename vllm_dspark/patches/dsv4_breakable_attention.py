"""DeepSeek-V4's attention run eagerly between PIECEWISE graph segments, as vLLM intends.

What: where ``DeepseekV4Attention.attention_impl`` (``vllm.models.deepseek_v4.attention``)
was decorated while vLLM's breakable CUDA graphs were off, and they are on now
(``VLLM_USE_BREAKABLE_CUDAGRAPH``), applies vLLM's own ``eager_break_during_capture`` to
it again.
Why: vLLM 0.26.0 turns breakable graphs on for DeepSeek-V4 in ``VllmConfig.__post_init__``,
after ``ModelConfig``'s quantization check has imported ``vllm.models.deepseek_v4`` (for
its FP8 config class). The decorator decides when the module is imported, so in that
process, and in an engine core forked from it, attention is captured inside the
PIECEWISE graphs with the capture run's metadata, and a replay reads stale memory
(docs/design/deepseek-v4.md). Setting ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` before vLLM
starts does the same for any engine.
Upstream: none known.
Remove when: the pinned vLLM decorates DeepSeek-V4's attention with its graphs' setting.
Applied by :mod:`vllm_dspark.patches.speculator_selection` when it builds the plugin's
speculator, before the runner captures graphs.
"""

from __future__ import annotations

import sys

from vllm_dspark.patches.wrapping import wrap

ATTENTION_MODULE = "vllm.models.deepseek_v4.attention"


def apply() -> None:
    module = sys.modules.get(ATTENTION_MODULE)
    if module is None:
        return  # imported later, when the graphs' setting is final
    from vllm.compilation.breakable_cudagraph import (
        eager_break_during_capture,
        is_breakable_cudagraph_enabled,
    )

    attention = module.DeepseekV4Attention
    if is_breakable_cudagraph_enabled() and not hasattr(attention.attention_impl, "__wrapped__"):
        wrap(attention, "attention_impl", eager_break_during_capture)
