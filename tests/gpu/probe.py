"""Run tests/gpu/llm_probe.py in a fresh process and return its JSON."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

PROBE = Path(__file__).with_name("llm_probe.py")


def without_dspark_plugin() -> str:
    """A VLLM_PLUGINS value that loads every general plugin but ours."""
    others = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    return ",".join(name for name in others if name != "vllm_dspark") or "none"


def run_probe(spec: dict, plugins: str | None = None, timeout: int = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSPARK_")}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # vLLM logs to stdout too: our line is the one with the marker.
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))
