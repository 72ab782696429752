"""What vLLM runs when it loads the plugin: a version check, then the patches."""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

from vllm_dspark import SUPPORTED_VLLM_VERSION, __version__

_registered = False


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the release this plugin was built for."""


def check_vllm_version(installed: str | None = None) -> None:
    installed = installed or version("vllm")
    parsed = Version(installed)
    if parsed.base_version != SUPPORTED_VLLM_VERSION or parsed.is_prerelease:
        raise UnsupportedVllmVersion(
            f"vllm-dspark {__version__} supports vLLM {SUPPORTED_VLLM_VERSION} only, "
            f"found vLLM {installed}: install vllm=={SUPPORTED_VLLM_VERSION} or "
            "uninstall vllm-dspark."
        )


def register() -> None:
    """Check the vLLM version and apply every patch; safe to call any number of times."""
    global _registered
    if not _registered:
        check_vllm_version()
        from vllm_dspark import patches

        patches.apply_all()
        _registered = True
    # On every call: the environment may have gained a variable since the last one.
    from vllm_dspark.config import register_environment_variables

    register_environment_variables()
