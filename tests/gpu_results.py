"""Where a GPU test writes what it measured: ``DSPARK_RESULTS_DIR`` (unset: nowhere)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from vllm_dspark.demo.report import first_difference


def write_result(filename: str, command: str, record: dict) -> None:
    """``record`` under the command, commit, date, device and the ``VLLM_*`` variables
    set (a stage's switches, e.g. breakable graphs), as ``filename`` in
    ``DSPARK_RESULTS_DIR``. The GPU machine gets a copy of the tree without its git
    history: the caller names the commit in ``DSPARK_COMMIT``."""
    results_dir = os.environ.get("DSPARK_RESULTS_DIR")
    if not results_dir:
        return
    import torch

    header = {
        "command": command,
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
    }
    Path(results_dir, filename).write_text(json.dumps(header | record, indent=2))


def first_divergences(outputs: dict, reference: dict, gaps: dict) -> dict:
    """For each output (by key) that differs from the reference's: the first position where
    they differ and the reference's top-two logprob gap there, how near a tie the greedy
    choice was ({key: {"position", "gap"}}). Outputs of one request have one length."""
    found = {}
    for key, tokens in outputs.items():
        theirs = reference[key]
        if tokens == theirs:
            continue
        position = first_difference(tokens, theirs)
        found[key] = {"position": position, "gap": gaps[key][position]}
    return found


def prompt_divergences(token_ids: list, reference: dict) -> dict:
    """:func:`first_divergences` of one arm's outputs (a list, one per prompt) against a
    reference probe result with ``token_ids`` and ``margins``, keyed by prompt index."""
    return first_divergences(
        dict(enumerate(token_ids)),
        dict(enumerate(reference["token_ids"])),
        dict(enumerate(reference["margins"])),
    )


def greedy_comparison(out: dict, reference: dict) -> dict:
    """One arm's probe result against no speculation's (``reference``: ``token_ids`` and
    ``margins``): identical or not, :func:`prompt_divergences`, its spec-decode and
    admission counts."""
    return {
        "greedy_token_ids_identical": out["token_ids"] == reference["token_ids"],
        "first_divergences": prompt_divergences(out["token_ids"], reference),
        "spec_decode": out["spec_decode"],
        "admission": out["admission"],
    }
