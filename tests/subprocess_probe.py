"""Run a probe script in a fresh Python process and return the JSON it reports.

Probes print their result as one line starting with ``PROBE `` (vLLM logs to stdout
too). A fresh process is how the tests load vLLM with or without this plugin.
"""

from __future__ import annotations

import json
import os
import signal
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
    # Its own session, so that a timeout ends every process it started (vLLM's engine core,
    # a sanitizer's target), not only the first: one left running would hold the GPU.
    with subprocess.Popen(
        [*prefix, sys.executable, str(script), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as probe:
        try:
            stdout, stderr = probe.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired as timeout_error:
            os.killpg(probe.pid, signal.SIGKILL)
            stdout, stderr = probe.communicate()
            # A result already printed means the probe hung on its way out (engine shutdown).
            where = "after printing its result" if MARKER in stdout else "before a result"
            raise TimeoutError(
                f"{script.name} ran past {timeout} s {where}; its error output ends:\n"
                + stderr[-6000:]
            ) from timeout_error
    assert probe.returncode == 0, stderr[-12000:]
    line = next(x for x in stdout.splitlines() if x.startswith(MARKER))
    return json.loads(line.removeprefix(MARKER))
