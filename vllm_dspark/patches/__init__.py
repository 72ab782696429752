"""Every change vllm-dspark makes to vLLM's behaviour, one module each.

Each module's docstring says what it changes, why, the upstream issue or PR, and
when it can go. Each exposes ``apply()``, which is idempotent; a patch changes
nothing while no vllm-dspark option is set.
"""

from vllm_dspark.patches import admission_metrics, speculative_options, speculator_selection

PATCHES = (speculative_options, speculator_selection, admission_metrics)


def apply_all() -> None:
    for patch in PATCHES:
        patch.apply()
