"""Progress lines for the demo's slow stages: what is happening, and for how long so far."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stage(
    index: int, total: int, text: str, heartbeat_s: float | None = None, out=print
) -> Iterator[None]:
    """Print ``[index/total] text…`` now, ``… N s`` every ``heartbeat_s`` while the stage
    runs (an engine start prints nothing of its own for a minute or more), and its elapsed
    seconds when it ends."""
    start = time.monotonic()
    out(f"[{index}/{total}] {text}…")
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            out(f"      … {time.monotonic() - start:.0f} s")

    ticker = threading.Thread(target=beat, daemon=True) if heartbeat_s else None
    if ticker:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker:
            ticker.join()
    out(f"      done in {time.monotonic() - start:.0f} s")
