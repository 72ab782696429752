"""`vllm-dspark doctor`: what this machine has, and whether it can run DSpark."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _gpu_checks() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("CUDA GPU", False, "none found: DSpark needs an NVIDIA GPU")]
    from vllm_dspark.head.draft_heads import MIN_FP8_CAPABILITY

    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    checks = [
        Check("CUDA GPU", True, f"{name}, compute capability {major}.{minor}"),
        # The capability the FP8 options check at start-up (check_fp8_supported).
        Check(
            "FP8 (e4m3)",
            (major, minor) >= MIN_FP8_CAPABILITY,
            "needed by dspark_fp8_draft_head, _markov_head and _draft_backbone",
        ),
    ]
    from vllm.triton_utils import HAS_TRITON

    checks.append(Check("Triton driver", HAS_TRITON, "vLLM's V2 model runner needs it"))
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        fa = get_flash_attn_version()
    except Exception as error:  # an unusable FlashAttention build names itself here
        fa, reason = None, f"FlashAttention unusable ({error}); "
    else:
        reason = ""
    if fa:
        checks.append(Check("draft attention", True, f"FlashAttention {fa} (non-causal)"))
    else:
        checks.append(
            Check("draft attention", HAS_TRITON, reason + "Triton attention (non-causal)")
        )
    return checks


def run_doctor(out=print) -> bool:
    """Print the report; return whether this machine can run DSpark."""
    from vllm_dspark import SUPPORTED_VLLM_VERSION, __version__
    from vllm_dspark.config import (
        ENV_PREFIX,
        KEY_PREFIX,
        DSparkOptionError,
        DSparkOptions,
        resolve_options,
    )

    vllm_version = _package_version("vllm")
    out(f"vllm-dspark {__version__} (Python {platform.python_version()})")
    out(f"  vLLM    {vllm_version} (supported: {SUPPORTED_VLLM_VERSION})")
    out(f"  torch   {_package_version('torch')}")
    out(f"  triton  {_package_version('triton')}")
    checks = [Check("vLLM version", vllm_version == SUPPORTED_VLLM_VERSION, "")]
    checks += _gpu_checks()
    try:
        resolve_options({})  # raises on a bad VLLM_DSPARK_* variable
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
        checks.append(Check("VLLM_DSPARK_* environment", True, str(env or "none set")))
    except DSparkOptionError as error:
        checks.append(Check("VLLM_DSPARK_* environment", False, str(error)))
    out("Options (--speculative-config key / environment variable, default):")
    for name, field in DSparkOptions.model_fields.items():
        summary = " ".join(field.description.split()).split(". ")[0].rstrip(".")
        out(f"  {KEY_PREFIX}{name} / {ENV_PREFIX}{name.upper()}  default {field.default!r}")
        out(f"      {summary}.")
        out(f"      valid: {field.json_schema_extra['valid']}")
    out("Checks:")
    for check in checks:
        mark = "ok " if check.ok else "NO "
        out(f"  [{mark}] {check.name}" + (f": {check.detail}" if check.detail else ""))
    can_run = all(check.ok for check in checks)
    out("This machine can run DSpark." if can_run else "This machine cannot run DSpark.")
    return can_run
