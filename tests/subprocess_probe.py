"""Run a probe script in a fresh Python process and return the JSON it reports.

Probes print their result as one line starting with ``PROBE `` (vLLM logs to stdout
too). A fresh process is how the tests load vLLM with or without this plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

MARKER = "PROBE "


def without_dspark_plugin() -> str:
    """A VLLM_PLUGINS value that loads every general plugin but ours."""
    others = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    return ",".join(name for name in others if name != "vllm_dspark") or "none"


def run_probe(
    script: Path,
    *args: str,
    stdin: str | None = None,
    plugins: str | None = None,
    timeout: int = 900,
    prefix: tuple[str, ...] = (),
):
    """``script args...`` (``stdin`` on its standard input: a spec too long for the command
    line) with no VLLM_DSPARK_* variables and the given VLLM_PLUGINS, under ``prefix``
    (e.g. a compute-sanitizer command line) if given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSPARK_")}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    done = subprocess.run(
        [*prefix, sys.executable, str(script), *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-12000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith(MARKER))
    return json.loads(line.removeprefix(MARKER))
