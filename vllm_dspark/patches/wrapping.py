"""Idempotent replacement of a vLLM attribute by a wrapper around it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# Set on every wrapper we install; holds the attribute it replaced.
ORIGINAL_ATTR = "__vllm_dspark_original__"


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless already wrapped."""
    current = getattr(owner, name)
    if hasattr(current, ORIGINAL_ATTR):
        return
    wrapper = functools.wraps(current)(make_wrapper(current))
    setattr(wrapper, ORIGINAL_ATTR, current)
    setattr(owner, name, wrapper)


def original(owner: Any, name: str) -> Callable:
    """The stock attribute behind a wrapper (the attribute itself when unwrapped)."""
    current = getattr(owner, name)
    return getattr(current, ORIGINAL_ATTR, current)
