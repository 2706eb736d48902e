"""The GDN layer's depthwise causal conv over a prefill run, with its silu, in one launch,
time-major.

A run's pre-conv projections come out of their GEMM as rows ``x`` ``[T, C]``; the conv of row
``t`` and channel ``c`` is ``sum_j w[c, j] * window[c, t + j]`` over the ``KW`` columns of the
window (the previous conv state's ``KW - 1`` columns, then the rows). In torch on a GPU that took
a transposed copy of the rows into a ``[C, KW - 1 + T]`` window, cuDNN's depthwise conv over it,
a silu, and the transposed copies the gated delta rule's operands were then made from (about
3 ms of a 2,048-token pass at the 27B widths, next to 16.5 ms of GEMMs). Here a program reads a
``[BT, BC]`` tile of the rows where they are (the rows before the run from the conv state),
sums the ``KW`` products in fp32, rounds to the model dtype (the conv's output dtype), applies
silu in fp32 and writes ``silu(conv)`` rounded again, time-major, so q, k and v are views of it.

:func:`conv_silu_ref` is the torch twin (the same rounding points); the kernel also runs under
Triton's interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_kernels.launch import tl, triton

BT = 32
BC = 128
NUM_WARPS = 4


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _conv_kernel(x, sx, st, ss, w, y, T, C, KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        o_t = tl.program_id(0) * BT + tl.arange(0, BT)
        o_c = tl.program_id(1) * BC + tl.arange(0, BC)
        m_t = o_t < T
        m_c = o_c < C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(KW):
            s = o_t + (j - (KW - 1))  # the window's row: < 0 is the conv state's column KW-1+s
            m_x = (m_t & (s >= 0))[:, None] & m_c[None, :]
            m_s = (m_t & (s < 0))[:, None] & m_c[None, :]
            v = tl.load(x + s[:, None].to(tl.int64) * sx + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
            v += tl.load(st + o_c[None, :] * ss + (s + (KW - 1))[:, None], mask=m_s, other=0.0).to(tl.float32)
            acc += v * tl.load(w + o_c * KW + j, mask=m_c, other=0.0).to(tl.float32)[None, :]
        conv = acc.to(y.dtype.element_ty).to(tl.float32)
        out = conv / (1.0 + tl.exp(-conv))
        tl.store(y + o_t[:, None].to(tl.int64) * C + o_c[None, :], out.to(y.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])


def conv_silu(state: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(causal_conv(window))`` ``[T, C]`` in ``x``'s dtype: ``state`` ``[C, KW-1]`` the
    columns before the run, ``x`` ``[T, C]`` the run's rows (unit stride along ``C``), ``w``
    ``[C, KW]`` contiguous."""
    T, C = x.shape
    KW = w.shape[1]
    assert state.shape == (C, KW - 1) and state.stride(1) == 1, f"conv state {tuple(state.shape)} for {C} channels"
    assert x.stride(1) == 1 and w.is_contiguous() and w.shape[0] == C, "rows and weights with unit channel stride"
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T:
        _conv_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](x, x.stride(0), state, state.stride(0), w, y, T, C,
                                                               KW=KW, BT=BT, BC=BC, num_warps=NUM_WARPS)
    return y


def conv_silu_ref(state: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`conv_silu` in torch: fp32 sums of the window's products, rounded to ``x``'s dtype,
    then silu rounded again."""
    KW = w.shape[1]
    rows = torch.cat([state.to(x.dtype).t(), x]).float()  # [KW-1+T, C]
    T = x.shape[0]
    acc = sum(rows[j:j + T] * w[:, j].float() for j in range(KW))
    return F.silu(acc.to(x.dtype).float()).to(x.dtype)
