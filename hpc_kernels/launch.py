"""Where the fused Triton kernels can launch: Triton imports, and the tensor is on CUDA, or
Triton's interpreter runs (``TRITON_INTERPRET=1``, read once at import as Triton reads it: the
kernels then run on CPU tensors, which is how the CPU tests check them)."""

from __future__ import annotations

import os

import torch

try:
    import triton
except Exception:  # no Triton, or one that cannot load here: the torch twins only
    triton = None

TRITON = triton is not None

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def launchable(x: torch.Tensor) -> bool:
    """Whether a fused kernel can take ``x``."""
    return TRITON and (x.is_cuda or INTERPRETING)
