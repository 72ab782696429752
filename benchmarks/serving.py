"""Start a real `vllm serve` on loopback for benchmarks and evals, and always stop it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def vllm_server(
    model: str,
    server_args: list[str] | str = (),
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    startup_timeout_s: float = 900.0,
):
    """Yield the base URL of a healthy `vllm serve`; stop the server on exit, even on error."""
    if isinstance(server_args, str):
        server_args = shlex.split(server_args)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *server_args,
    ]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    # A new session, so that stopping it also stops the engine-core and worker processes.
    process = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {startup_timeout_s:.0f} s")
            time.sleep(2)
        yield base_url
    finally:
        _stop(process)
        if log_path:
            log.close()


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def scrape_metrics(base_url: str) -> str:
    """The Prometheus text of `/metrics`."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        return response.read().decode()


def collective_rpc(base_url: str, method: str) -> list:
    """Each rank's result of a worker method through ``POST /collective_rpc`` (a server
    started with ``VLLM_SERVER_DEV_MODE=1``)."""
    request = urllib.request.Request(
        base_url + "/collective_rpc",
        data=json.dumps({"method": method}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["results"]
