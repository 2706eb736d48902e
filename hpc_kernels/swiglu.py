"""The MLP's gate, ``silu(gate) * up``, in one launch (torch: a silu and a product, each a pass
over the ``[rows, intermediate]`` activations, 17,408 wide at the 27B widths). The same rounding
points as torch's: silu in fp32 rounded to the inputs' dtype, the product in fp32 rounded again.
:func:`swiglu_ref` is the torch twin; the kernel also runs under Triton's interpreter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_kernels.launch import as_rows, tl, triton

BLOCK = 2048
NUM_WARPS = 4


if triton is not None:
    @triton.jit
    def _swiglu_kernel(g, sg, u, su, y, D, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < D
        gf = tl.load(g + row * sg + o, mask=m, other=0.0).to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(y.dtype.element_ty).to(tl.float32)
        uf = tl.load(u + row * su + o, mask=m, other=0.0).to(tl.float32)
        tl.store(y + row * D + o, (act * uf).to(y.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[..., D]`` operands."""
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)}, up {tuple(up.shape)}"
    g2, u2 = as_rows(gate), as_rows(up)
    n, D = g2.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if n:
        _swiglu_kernel[(n, triton.cdiv(D, BLOCK))](g2, g2.stride(0), u2, u2.stride(0), y, D, BLOCK=BLOCK,
                                                   num_warps=NUM_WARPS)
    return y


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
