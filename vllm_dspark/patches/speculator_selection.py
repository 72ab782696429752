"""Build vllm-dspark's speculator when an option asks for it.

What: wraps ``init_speculator`` where it is defined (``vllm.v1.worker.gpu.spec_decode``,
a light module). The V2 model runner imports it by name, and vLLM loads plugins in a
worker before it imports the runner, so the runner binds the wrapper; if the runner
is already imported, its binding is wrapped too. When the ``VllmConfig`` carries vllm-dspark
options, DSpark and DFlash get :mod:`vllm_dspark.speculator`'s subclasses; otherwise
the stock function runs, so the speculator is stock's.
Why: vLLM 0.26.0 picks the speculator by a fixed if/elif on the method; it has no
registry a plugin could add to.
Upstream: a speculator registry is proposed in vllm-project/vllm#36219.
Remove when: vLLM lets plugins register speculators.
"""

from __future__ import annotations

import sys

import vllm.v1.worker.gpu.spec_decode as spec_decode

from vllm_dspark.config import DSparkOptions
from vllm_dspark.patches.wrapping import wrap


def _make_wrapper(init_speculator):
    def init_speculator_with_dspark(vllm_config, device):
        options = DSparkOptions.from_vllm_config(vllm_config)
        method = vllm_config.speculative_config.method
        if not options.active or method not in ("dspark", "dflash"):
            return init_speculator(vllm_config, device)
        from vllm_dspark.speculator import DFlashPluginSpeculator, DSparkPluginSpeculator

        cls = DSparkPluginSpeculator if method == "dspark" else DFlashPluginSpeculator
        speculator = cls(vllm_config, device, options)
        if method == "dspark":
            # Before the runner captures graphs: DeepSeek-V4's attention out of them.
            from vllm_dspark.patches import dsv4_breakable_attention

            dsv4_breakable_attention.apply()
        if speculator.controller.controls_capacity:
            # The runner is imported by now: its own hooks go in only when needed.
            from vllm_dspark.patches import admission_metrics, compact_verification, dsv4_compact

            compact_verification.apply()
            dsv4_compact.apply()
            admission_metrics.apply_to_runner()
        if speculator.controller.needs_sps_profile:
            from vllm_dspark.patches import sps_autoprofile

            sps_autoprofile.apply()
        if getattr(speculator, "synthetic", None) is not None:
            from vllm_dspark.bench import synthetic_acceptance

            synthetic_acceptance.apply(speculator)
        return speculator

    return init_speculator_with_dspark


RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def apply() -> None:
    wrap(spec_decode, "init_speculator", _make_wrapper)
    # Importing the runner here would load GPU code into every process; only an
    # already imported runner needs its own binding wrapped.
    if RUNNER_MODULE in sys.modules:
        wrap(sys.modules[RUNNER_MODULE], "init_speculator", _make_wrapper)
