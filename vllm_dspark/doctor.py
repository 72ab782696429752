"""`vllm-dspark doctor`: what this machine has, and whether it can run DSpark.

What the machine has is gathered once (:func:`inspect_machine`); the checks are plain
functions of it (:func:`machine_checks`), so that they can be tested on any machine. A
failed *required* check means DSpark cannot run here, and the command exits non-zero; an
optional one (FP8) only rules out the options that need it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

NOT_INSTALLED = "not installed"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


@dataclass
class Machine:
    """The facts the checks read."""

    vllm_version: str
    gpu_name: str | None = None  # None: no CUDA GPU
    capability: tuple[int, int] | None = None
    torch_cuda_archs: list[str] = field(default_factory=list)  # what torch was built for
    has_triton: bool = False  # Triton with a usable GPU driver (vLLM's check)
    flash_attention: int | None = None  # FlashAttention version vLLM would use
    flash_attention_error: str | None = None


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return NOT_INSTALLED


def inspect_machine() -> Machine:
    """What this machine has. Reads CUDA through torch (this process starts no engine)."""
    import torch

    machine = Machine(vllm_version=package_version("vllm"))
    if not torch.cuda.is_available():
        return machine
    machine.gpu_name = torch.cuda.get_device_name(0)
    machine.capability = torch.cuda.get_device_capability(0)
    machine.torch_cuda_archs = torch.cuda.get_arch_list()
    if machine.vllm_version == NOT_INSTALLED:
        return machine
    from vllm.triton_utils import HAS_TRITON

    machine.has_triton = HAS_TRITON
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        machine.flash_attention = get_flash_attn_version()
    except Exception as error:  # an unusable FlashAttention build names itself here
        machine.flash_attention_error = str(error)
    return machine


def _oldest_arch(archs: list[str]) -> tuple[int, int] | None:
    """The oldest compute capability torch's CUDA kernels were built for (sm_75 -> 7.5)."""
    built = [arch.split("_")[1] for arch in archs if arch.startswith("sm_")]
    versions = [(int(sm[:-1]), int(sm[-1])) for sm in built if sm.isdigit()]
    return min(versions) if versions else None


def machine_checks(machine: Machine, supported_vllm: str) -> list[Check]:
    """What DSpark needs (required) and what some options need (optional)."""
    checks = [
        Check(
            "vLLM version",
            machine.vllm_version == supported_vllm,
            f"{machine.vllm_version}; the plugin is written for {supported_vllm}",
        )
    ]
    if machine.gpu_name is None:
        return checks + [Check("CUDA GPU", False, "none found: DSpark needs an NVIDIA GPU")]
    major, minor = machine.capability
    checks.append(
        Check("CUDA GPU", True, f"{machine.gpu_name}, compute capability {major}.{minor}")
    )
    oldest = _oldest_arch(machine.torch_cuda_archs)
    if oldest is not None:
        checks.append(
            Check(
                "compute capability",
                machine.capability >= oldest,
                f"{major}.{minor}; this torch's CUDA kernels start at {oldest[0]}.{oldest[1]}",
            )
        )
    if machine.vllm_version == NOT_INSTALLED:
        return checks  # what follows is vLLM's
    # The capability the FP8 options check at start-up (check_fp8_supported).
    from vllm_dspark.head.draft_heads import MIN_FP8_CAPABILITY

    checks.append(Check("Triton driver", machine.has_triton, "vLLM's V2 model runner needs it"))
    if machine.flash_attention:
        attention = Check(
            "draft attention", True, f"FlashAttention {machine.flash_attention} (non-causal)"
        )
    else:
        reason = (
            f"FlashAttention unusable ({machine.flash_attention_error}); "
            if machine.flash_attention_error
            else ""
        )
        attention = Check(
            "draft attention", machine.has_triton, reason + "Triton attention (non-causal)"
        )
    checks.append(attention)
    fp8 = machine.capability >= MIN_FP8_CAPABILITY
    checks.append(
        Check(
            "FP8 (e4m3)",
            fp8,
            "dspark_fp8_draft_head, _markov_head and _draft_backbone can run"
            if fp8
            else f"needs compute capability {MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}: "
            "the dspark_fp8_* options are unavailable, everything else runs",
            required=False,
        )
    )
    return checks


def environment_check() -> Check:
    """Whether the VLLM_DSPARK_* variables set here parse."""
    from vllm_dspark.config import ENV_PREFIX, DSparkOptionError, resolve_options

    try:
        resolve_options({})  # raises on a bad VLLM_DSPARK_* variable
    except DSparkOptionError as error:
        return Check("VLLM_DSPARK_* environment", False, str(error))
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    return Check("VLLM_DSPARK_* environment", True, str(env or "none set"))


def _mark(check: Check) -> str:
    if check.ok:
        return "ok "
    return "NO " if check.required else " - "


def run_doctor(out=print, machine: Machine | None = None) -> bool:
    """Print the report; return whether this machine can run DSpark (every required check
    passed). ``machine``: the facts to judge (default: this machine's)."""
    from vllm_dspark import SUPPORTED_VLLM_VERSION, __version__
    from vllm_dspark.config import ENV_PREFIX, KEY_PREFIX, DSparkOptions

    machine = machine or inspect_machine()
    out(f"vllm-dspark {__version__} (Python {platform.python_version()})")
    out(f"  vLLM    {machine.vllm_version} (supported: {SUPPORTED_VLLM_VERSION})")
    out(f"  torch   {package_version('torch')}")
    out(f"  triton  {package_version('triton')}")
    checks = machine_checks(machine, SUPPORTED_VLLM_VERSION) + [environment_check()]
    out("Options (--speculative-config key / environment variable, default):")
    for name, option in DSparkOptions.model_fields.items():
        summary = " ".join(option.description.split()).split(". ")[0].rstrip(".")
        out(f"  {KEY_PREFIX}{name} / {ENV_PREFIX}{name.upper()}  default {option.default!r}")
        out(f"      {summary}.")
        out(f"      valid: {option.json_schema_extra['valid']}")
    out("Checks ([ - ]: optional, only the options named need it):")
    for check in checks:
        out(f"  [{_mark(check)}] {check.name}" + (f": {check.detail}" if check.detail else ""))
    can_run = all(check.ok for check in checks if check.required)
    if can_run:
        out("This machine can run DSpark.")
    else:
        failed = ", ".join(check.name for check in checks if check.required and not check.ok)
        out(f"This machine cannot run DSpark ({failed}).")
        if machine.gpu_name is None:
            out(
                "  `vllm-dspark demo` still runs the PyTorch reference of a DSpark step on the CPU."
            )
    return can_run
