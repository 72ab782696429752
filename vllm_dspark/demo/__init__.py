"""`vllm-dspark demo`: the embedded model pair, without and with DSpark.

On a CUDA GPU (:mod:`.gpu`) the pair is served by vLLM with no speculation, fixed k and
the recommended adaptive configuration, at a light and a heavy load; on a machine
without one (:mod:`.cpu`) the project's PyTorch reference of a DSpark step runs the same
pair on the CPU. This module stays light (no torch, no vLLM), so that the command line
can validate its arguments before anything heavy loads.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

EMBEDDED_PAIR = Path(str(files("vllm_dspark") / "data" / "tiny_pair"))


def load_prompts(pair_dir: Path = EMBEDDED_PAIR, num_prompts: int | None = 200) -> list[list[int]]:
    """Token ids of the pair's first ``num_prompts`` held-out prompts (never seen in
    training; None: all of them)."""
    prompts = json.loads((pair_dir / "heldout_prompts.json").read_text())
    return [prompt["prompt_token_ids"] for prompt in prompts[:num_prompts]]


def draft_block_size(pair_dir: Path = EMBEDDED_PAIR) -> int:
    """Drafts the pair's drafter proposes per step: the most a step can verify."""
    return json.loads((pair_dir / "draft" / "config.json").read_text())["block_size"]


def num_heldout_prompts(pair_dir: Path = EMBEDDED_PAIR) -> int:
    return len(json.loads((pair_dir / "heldout_prompts.json").read_text()))
