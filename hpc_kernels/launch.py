"""What the fused Triton kernels share: Triton itself (``triton``/``tl``, None where it does not
import), where they can launch (the tensor on CUDA, or Triton's interpreter running:
``TRITON_INTERPRET=1``, read once at import as Triton reads it, which is how the CPU tests check
them), and their view of an operand as rows."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton, or one that cannot load here: the torch twins only
    triton = tl = None

TRITON = triton is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def launchable(x: torch.Tensor) -> bool:
    """Whether a fused kernel can take ``x``."""
    return TRITON and (x.is_cuda or INTERPRETING)


def as_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` as ``[tokens, heads, D]`` (``[rows, 1, D]`` for two dims or fewer) with
    unit stride along ``D``: a view where the leading dims merge, as a projection's heads inside
    a wider product, else a copy."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() >= 3 else x.reshape(-1, 1, x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` as ``[rows, D]`` at a uniform row stride and unit stride along ``D`` (a
    view where the layout allows, as a head's rows inside a wider projection, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
