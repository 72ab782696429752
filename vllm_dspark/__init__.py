"""vllm-dspark: fast and safe DSpark/DFlash speculative decoding on stock vLLM.

A vLLM general plugin: vLLM calls :func:`register` in every process it starts.
"""

__version__ = "0.1.0"

# The one vLLM release this plugin is written and tested against.
SUPPORTED_VLLM_VERSION = "0.26.0"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm_dspark.plugin import register as _register

    _register()
