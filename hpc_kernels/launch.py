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

try:  # programmatic dependent launch (Hopper and later): a Triton that launches it (3.3+)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL_TRITON = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
except Exception:  # no Triton, an older one, or no NVIDIA backend
    PDL_TRITON = False
    if triton is not None:
        @triton.jit
        def gdc_launch_dependents():
            pass

        @triton.jit
        def gdc_wait():
            pass

#: launch the kernels that take it as programmatic dependents (``HPC_PDL=1``): a kernel may then
#: start while the one before it runs, doing what does not depend on it (a product reads its
#: weight) before it waits for it (``gdc_wait``) and lets the next one start
#: (``gdc_launch_dependents``)
PDL = os.environ.get("HPC_PDL", "0") == "1"


def pdl_args(x: torch.Tensor) -> dict:
    """The launch arguments of a kernel taking ``PDL`` for a pass on ``x``'s device: ``PDL`` and
    ``launch_pdl`` where :data:`PDL` is on and the device launches programmatic dependents, else
    none."""
    if not (PDL and x.is_cuda):
        return {}
    return {"PDL": True, "launch_pdl": True} if _pdl_device(x.device.index or 0) else {}


_PDL_DEVICES: dict[int, bool] = {}


def _pdl_device(index: int) -> bool:
    ok = _PDL_DEVICES.get(index)
    if ok is None:
        ok = _PDL_DEVICES[index] = PDL_TRITON and not INTERPRETING and torch.cuda.get_device_capability(index) >= (9, 0)
    return ok


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
