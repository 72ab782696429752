"""Build real vLLM configs on a machine without a GPU.

vLLM's CUDA wheel detects no platform there, so configs fail ("Device string must
not be empty"). Selecting vLLM's own CPU platform before anything resolves
``vllm.platforms.current_platform`` fixes that; it must run before the first
import of vLLM's config modules, which bind the platform at import time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from shapes import write_shape  # noqa: E402


def select_cpu_platform() -> bool:
    """Use vLLM's CPU platform when there is no CUDA GPU; return whether it did."""
    if torch.cuda.is_available():
        return False
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    return True


def write_model_dirs(root: Path) -> dict[str, str]:
    """Config-only checkpoints of the tiny shape: a target, DSpark drafts with and without
    a confidence head, and a DFlash draft. Returns their paths by name."""
    paths = write_shape("tiny", root, draft_layers=1)
    draft = json.loads((Path(paths["draft"]) / "config.json").read_text())
    variants = {
        "dspark": dict(draft, enable_confidence_head=True),
        "dspark_no_confidence": draft,
    }
    for name, config in variants.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        paths[name] = str(folder)
    return paths
