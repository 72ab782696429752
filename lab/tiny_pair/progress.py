"""Progress bars that stay readable in captured logs (rare refreshes when not a terminal)."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(**kwargs) -> tqdm:
    interactive = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.5 if interactive else 30.0)
    kwargs.setdefault("leave", interactive)
    return tqdm(**kwargs)
