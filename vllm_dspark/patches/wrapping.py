"""Idempotent replacement of a vLLM attribute by a wrapper around it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

# Set on every wrapper we install; holds the attribute it replaced.
ORIGINAL_ATTR = "__vllm_dspark_original__"


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless already wrapped. A
    classmethod stays one: its function is wrapped and receives the class first."""
    current = getattr(owner, name)  # a bound classmethod reads attributes of its function
    if hasattr(current, ORIGINAL_ATTR):
        return
    is_classmethod = isinstance(inspect.getattr_static(owner, name), classmethod)
    if is_classmethod:
        current = current.__func__
    wrapper = functools.wraps(current)(make_wrapper(current))
    setattr(wrapper, ORIGINAL_ATTR, current)
    setattr(owner, name, classmethod(wrapper) if is_classmethod else wrapper)


def original(owner: Any, name: str) -> Callable:
    """The stock attribute behind a wrapper (the attribute itself when unwrapped)."""
    current = getattr(owner, name)
    return getattr(current, ORIGINAL_ATTR, current)
