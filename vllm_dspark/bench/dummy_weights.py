"""Finish a dummy-weight DeepSeek-V4 target the way a checkpoint load finishes it.

What: importing this module wraps ``DummyModelLoader.load_weights``: after vLLM's random
values, every module that has ``finalize_mhc_broadcast_weights`` runs it (DeepSeek-V4's
first layer sums its hyper-connection weights into ``hc_attn_fn_broadcast``).
Why: vLLM 0.26.0 calls that finalizer only from the checkpoint path's ``load_weights``,
so a DeepSeek-V4 target with ``load_format="dummy"`` fails its first forward on
``assert self.hc_attn_fn_broadcast is not None``. Other models have no such finalizer and
load as before.
How: name :class:`DummyWeightsExtension` as the engine's ``worker_extension_cls`` (vLLM
imports it in every worker before the model loads); benchmark drivers do this for dummy
weights. vLLM takes one extension class, so it also carries
:class:`~vllm_dspark.metrics.ServedCounters`' calls and applies
:mod:`.parallel_warmup` (inert unless its variable is set).
Upstream: none (vLLM's dummy loader runs no model finalizers).
Remove when: vLLM's dummy loader finishes DeepSeek-V4's weights itself.
"""

from __future__ import annotations

from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

from vllm_dspark.bench import parallel_warmup
from vllm_dspark.metrics import ServedCounters
from vllm_dspark.patches.wrapping import wrap

FINALIZER = "finalize_mhc_broadcast_weights"


class DummyWeightsExtension(ServedCounters):
    """Naming this worker extension imports this module (the wrapper) in the workers."""


def _make_wrapper(load_weights):
    def load_weights_then_finalize(self, model, model_config):
        load_weights(self, model, model_config)
        for module in model.modules():
            finalize = getattr(module, FINALIZER, None)
            if callable(finalize):
                finalize()

    return load_weights_then_finalize


def apply() -> None:
    wrap(DummyModelLoader, "load_weights", _make_wrapper)
    parallel_warmup.apply()


apply()
