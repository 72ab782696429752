"""Where the plugin's own Triton kernels run instead of their PyTorch definitions."""

from __future__ import annotations

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """On a GPU; and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), so
    that the CPU tests run the kernels through the same code paths as a GPU would."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
