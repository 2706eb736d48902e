"""DFlash2's dynamic 2-tap convolution over a draft block's columns in one launch (before its
output projection): ``y_t = a_t x_t + b_t x_{t-1}`` with ``(a_t, b_t) = softmax(W x_t)``, ``W`` the
``[2, H]`` tap projection, ``x_{-1} = 0`` at each block's first column.

In torch that is the tap product, the softmax, its cast, and two products and a sum (one product
at a one-column block): four to six launches a layer for a few rows. Here one program per row
takes the row and the one before it, the two tap sums in fp32, and writes the mixed row, with
torch's rounding points: the taps rounded to the rows' dtype as the product's output, the softmax
in fp32 rounded, each product rounded, then the sum. :func:`dynamic_conv_ref` is the torch twin;
the kernel runs under Triton's interpreter too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_kernels.launch import tl, triton


if triton is not None:
    @triton.jit
    def _conv_kernel(x, sx, w, y, T, H, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = row % T
        o = tl.arange(0, BLOCK)
        m = o < H
        dt = y.dtype.element_ty
        xr = tl.load(x + row * sx + o, mask=m, other=0.0).to(tl.float32)
        t0 = tl.sum(xr * tl.load(w + o, mask=m, other=0.0).to(tl.float32), 0).to(dt).to(tl.float32)
        t1 = tl.sum(xr * tl.load(w + H + o, mask=m, other=0.0).to(tl.float32), 0).to(dt).to(tl.float32)
        top = tl.maximum(t0, t1)
        e0 = tl.exp(t0 - top)
        e1 = tl.exp(t1 - top)
        a = (e0 / (e0 + e1)).to(dt).to(tl.float32)
        b = (e1 / (e0 + e1)).to(dt).to(tl.float32)
        lim = tl.where(t > 0, H, 0)  # a block's first column has nothing before it
        prev = tl.load(x + (row - 1) * sx + o, mask=o < lim, other=0.0).to(tl.float32)
        out = (a * xr).to(dt).to(tl.float32) + (b * prev).to(dt).to(tl.float32)
        tl.store(y + row * H + o, out.to(dt), mask=m)


def dynamic_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The mixed columns ``[B, T, H]`` of blocks ``x`` ``[B, T, H]`` with tap weights ``w`` ``[2, H]``."""
    B, T, H = x.shape
    assert w.shape == (2, H), f"taps {tuple(w.shape)} for rows of {H}"
    x2 = x.reshape(B * T, H)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(B, T, H, dtype=x.dtype, device=x.device)
    if B * T:
        _conv_kernel[(B * T,)](x2, x2.stride(0), w.contiguous(), y, T, H, BLOCK=triton.next_power_of_2(H),
                               num_warps=4)
    return y


def dynamic_conv_ref(x: torch.Tensor, w: torch.Tensor | None, taps: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dynamic_conv`'s torch twin (the drafter's path off the fused kernels); ``taps``: the
    tap product ``x w^T`` where the caller has made it (the drafter's own projection)."""
    taps = torch.softmax(F.linear(x, w) if taps is None else taps, dim=-1, dtype=torch.float32).to(x.dtype)
    if x.shape[1] == 1:  # one column: nothing before it (the zero tap adds exactly nothing)
        return taps[..., :1] * x
    prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
    return taps[..., :1] * x + taps[..., 1:] * prev
