"""One GDN decode column in one launch: the causal conv of the new token, silu, the gates, the
l2 norms of q and k, and the gated delta rule's step on the state, read from and written to the
state slots in place.

In torch the same column is some 30 launches per GDN layer (the conv window's product-sum,
silu, the gate math, repeating the key heads for the value heads, fla's recurrent kernel, and a
gather and a scatter of the 3 MiB state around it at the 27B widths); at batch 1 on a GPU each
launch costs more than its work. Here one program takes one lane, one value head and a block of
``BV`` value columns:

* the conv of column ``t`` over the lane's window ``win[b, :, t : t + KW]`` (``win`` ``[B, C,
  KW - 1 + T]``: the conv state's ``KW - 1`` columns, then the pass's pre-conv projections),
  rounded to the model dtype as the conv's output is, then silu, rounded again (the values the
  torch path hands fla); for its key head's ``K`` q and k channels and its ``BV`` v channels;
* ``q, k`` l2-normalised in fp32 (q scaled by ``K^-1/2``), ``beta = sigmoid(b)`` (rounded to the
  model dtype), ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32;
* the step, in fla's fused recurrent order: ``S *= exp(g)``, ``v' = beta (v - S^T k)``,
  ``S += k v'^T``, ``o = S^T q``; the fp32 state block read from row ``in`` of ``s_in`` and
  written to row ``out`` of ``s_out`` (the same slot for decode: in place, each program owns its
  block), ``o`` in the model dtype.

Decode itself (:func:`gdn_decode_step`, one column a lane) runs it in two launches that read
and write both states where they lie: a conv kernel takes each lane's conv state from its slot
and the new projection row, writes ``silu(conv)`` and shifts the state in place; the step reads
those values (``ACT``) instead of a window, and zeros the rows past the lanes (the pass's
padding to a row block). The gather of the conv states, the window's concatenation, the
padding's concatenation and the scatter of the new states (five launches, about 10 us a layer
at batch 1) are gone. The conv's sums run in the window's order with the same rounding points.

A lane's column depends on its own window, projections and state alone, so the verify pass's
columns equal decode's bit for bit. They run in one launch: a program steps its state block
column by column in registers, each column the code of a one-column launch on the state that
launch would read back (fp32, stored and loaded unchanged), so ``T`` columns in one launch, in
``T`` launches, or in decode's launches give the same bits (:func:`gdn_step`'s ``columns``; a
verify pass's GDN layer is two launches, the window and the steps, whatever its ``k``). The state rows are a
lane's slot (``IN_SLOT``/``OUT_SLOT``: read from ``in_idx``/``out_idx`` on the device) or row
``b * T + t`` of a ``[B * T, ...]`` buffer (the verify pass keeps every column's state). No
argument depends on values, so the launch is captured in the decode graphs.

:func:`gdn_step_ref` is the torch twin (the same rounding points), checked against the kernel
under Triton's interpreter; the model's CPU path keeps its own ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_kernels.launch import tl, triton

#: value columns per program (one lane and value head has ``V / BV`` programs)
BV = 32
NUM_WARPS = 2
#: channels per program of decode's conv (:func:`gdn_decode_step`)
CONV_BC = 256


def supported(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes these head dims (Triton present, powers of two, ``<= 256``)."""
    pow2 = lambda d: d > 0 and d & (d - 1) == 0 and d <= 256  # noqa: E731
    return triton is not None and pow2(key_dim) and pow2(value_dim)


if triton is not None:
    @triton.jit
    def _silu_of_conv(acc, dt: tl.constexpr):
        """A conv's fp32 sums rounded to the model dtype (the conv's output), then silu in fp32,
        rounded again: the values the torch path hands fla, in fp32."""
        x = acc.to(dt).to(tl.float32)
        return (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)

    @triton.jit
    def _conv_step_kernel(x, sx, conv, sc_n, sc_c, idx, conv_w, act, C, KW: tl.constexpr, BC: tl.constexpr):
        """Decode's conv for lane ``program_id(0)`` and ``BC`` channels: the window is the lane's
        conv state (``KW - 1`` columns of its slot, in the model dtype) then its new projection
        ``x``; the sums in the window's order (as :func:`_step_kernel` sums them), silu, into
        ``act``; the state shifted by one column in place (each program owns its channels)."""
        i_b = tl.program_id(0).to(tl.int64)
        o_c = tl.program_id(1) * BC + tl.arange(0, BC)
        m_c = o_c < C
        dt = act.dtype.element_ty
        lane = conv + tl.load(idx + i_b) * sc_n + o_c * sc_c
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KW - 1):
            col = tl.load(lane + j, mask=m_c, other=0.0).to(dt)
            acc += col.to(tl.float32) * tl.load(conv_w + o_c * KW + j, mask=m_c, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(lane + j - 1, col.to(conv.dtype.element_ty), mask=m_c)
        new = tl.load(x + i_b * sx + o_c, mask=m_c, other=0.0).to(dt)
        acc += new.to(tl.float32) * tl.load(conv_w + o_c * KW + KW - 1, mask=m_c, other=0.0).to(tl.float32)
        tl.store(lane + KW - 2, new.to(conv.dtype.element_ty), mask=m_c)
        tl.store(act + i_b * C + o_c, _silu_of_conv(acc, dt).to(dt), mask=m_c)

    @triton.jit(do_not_specialize=["T"])
    def _window_kernel(conv, sc_n, sc_c, idx, x, sx, win, C, T, KW: tl.constexpr, BC: tl.constexpr):
        """The verify pass's conv window of lane ``program_id(0)`` and ``BC`` channels: its conv
        state (``KW - 1`` columns of its slot), then its ``T`` columns' pre-conv projections
        (rows ``b * T + t`` of ``x``), into ``win`` ``[B, C, KW - 1 + T]`` (contiguous)."""
        i_b = tl.program_id(0).to(tl.int64)
        o_c = tl.program_id(1) * BC + tl.arange(0, BC)
        m_c = o_c < C
        dt = win.dtype.element_ty
        width = KW - 1 + T
        dst = win + i_b * C * width + o_c * width
        lane = conv + tl.load(idx + i_b) * sc_n + o_c * sc_c
        for j in tl.static_range(KW - 1):
            tl.store(dst + j, tl.load(lane + j, mask=m_c, other=0.0).to(dt), mask=m_c)
        for t in range(T):
            tl.store(dst + KW - 1 + t, tl.load(x + (i_b * T + t) * sx + o_c, mask=m_c, other=0.0).to(dt), mask=m_c)

    @triton.jit(do_not_specialize=["t0", "t1", "T", "B", "PAD0", "ROWS"])
    def _step_kernel(win, sw_b, sw_c, conv_w, a, sa, b, sb, A_log, dt_bias,
                     s_in, in_idx, s_out, out_idx, o, t0, t1, T, B, PAD0, ROWS, scale,
                     HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KW: tl.constexpr,
                     BV: tl.constexpr, IN_SLOT: tl.constexpr, OUT_SLOT: tl.constexpr, ACT: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        i_v = tl.program_id(1)
        i_b, i_h = pid // HV, pid % HV
        dt = o.dtype.element_ty
        o_v = i_v * BV + tl.arange(0, BV)
        i_k = i_h // (HV // HK)
        o_k = tl.arange(0, K)
        # the channels of this program's q, k and v in the conv's [q | k | v] layout
        c_q = i_k * K + o_k
        c_k = HK * K + i_k * K + o_k
        c_v = 2 * HK * K + i_h * V + o_v
        # the state block [K, BV] before column t0, read by row; columns t0 .. t1 - 1 step it in
        # registers (the values a launch a column would store and read back: fp32 both ways)
        if IN_SLOT:
            r_in = tl.load(in_idx + i_b)
        else:
            r_in = i_b * T + t0 - 1
        blk = i_h * K * V + o_k[:, None] * V + o_v[None, :]
        S = tl.load(s_in + r_in * HV * K * V + blk)
        A = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h).to(tl.float32)
        if OUT_SLOT:
            r_slot = tl.load(out_idx + i_b)
        for t in range(t0, t1):
            lane = win + i_b * sw_b + t
            if ACT:  # silu(conv) of the column, from _conv_step_kernel ([lanes, C])
                q = tl.load(lane + c_q).to(tl.float32)
                k = tl.load(lane + c_k).to(tl.float32)
                v = tl.load(lane + c_v).to(tl.float32)
            else:
                q = tl.zeros([K], dtype=tl.float32)
                k = tl.zeros([K], dtype=tl.float32)
                v = tl.zeros([BV], dtype=tl.float32)
                for j in tl.static_range(KW):
                    q += tl.load(lane + c_q * sw_c + j).to(tl.float32) * tl.load(conv_w + c_q * KW + j).to(tl.float32)
                    k += tl.load(lane + c_k * sw_c + j).to(tl.float32) * tl.load(conv_w + c_k * KW + j).to(tl.float32)
                    v += tl.load(lane + c_v * sw_c + j).to(tl.float32) * tl.load(conv_w + c_v * KW + j).to(tl.float32)
                q = _silu_of_conv(q, dt)
                k = _silu_of_conv(k, dt)
                v = _silu_of_conv(v, dt)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
            # the gates of this lane's column t and value head
            r_ab = i_b * T + t
            b_raw = tl.load(b + r_ab * sb + i_h).to(tl.float32)
            beta = (1.0 / (1.0 + tl.exp(-b_raw))).to(dt).to(tl.float32)
            x = tl.load(a + r_ab * sa + i_h).to(tl.float32) + bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            g = A * softplus
            S *= tl.exp(g)
            vn = (v - tl.sum(S * k[:, None], 0)) * beta
            S += k[:, None] * vn[None, :]
            out = tl.sum(S * q[:, None], 0)
            if OUT_SLOT:
                if t == t1 - 1:  # a slot keeps the last column's state
                    tl.store(s_out + r_slot * HV * K * V + blk, S)
            else:
                tl.store(s_out + r_ab * HV * K * V + blk, S)
            tl.store(o + (r_ab * HV + i_h) * V + o_v, out.to(dt))
        # the rows of o from PAD0 to ROWS (the pass's padding to a row block): zeros, written by
        # the lanes' programs in turn
        for r in range(PAD0 + i_b, ROWS, B):
            tl.store(o + (r * HV + i_h) * V + o_v, tl.zeros([BV], dtype=dt))


def gdn_step(win: torch.Tensor, t: int, conv_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, s_in: torch.Tensor, in_idx: torch.Tensor | None,
             s_out: torch.Tensor, out_idx: torch.Tensor | None, n_k: int, T: int, o: torch.Tensor,
             columns: int = 1) -> None:
    """Columns ``t .. t + columns - 1`` of the lanes' GDN step in one launch (see the module doc).
    ``win`` ``[B, C, KW-1+T]`` contiguous; ``conv_w`` ``[C, KW]``; ``a``, ``b`` ``[rows, HV]``: row
    ``b * T + t`` holds the lane's gate inputs; ``s_in``/``s_out`` fp32 ``[N, HV, K, V]``
    contiguous. The state before column ``t`` is row ``in_idx[b]`` of ``s_in`` (``[B]`` int64 on
    the device), or, where None, row ``b * T + t - 1``; each column's state goes to row ``b * T +
    t`` of ``s_out``, or, with ``out_idx``, the last column's to row ``out_idx[b]``. A program
    keeps its state block in registers from column to column: each column computes what a launch
    of its own computes, bit for bit (the same code; the state it would store and read back is
    fp32 both ways). Row ``b * T + t`` of ``o`` ``[R, HV, V]`` (the model dtype, ``R >= B * T``)
    is written, and a launch that reaches the last column (``t + columns == T``) zeros the rows
    past ``B * T`` (the pass's padding to a row block: no launch of its own)."""
    B, C, _ = win.shape
    HV, K, V = s_in.shape[1:]
    KW = conv_w.shape[1]
    assert win.is_contiguous() and s_in.is_contiguous() and s_out.is_contiguous() and conv_w.is_contiguous(), \
        "the GDN step reads contiguous windows, weights and states"
    assert s_in.dtype == torch.float32 and s_out.dtype == torch.float32, "the GDN states are fp32"
    assert C == 2 * n_k * K + HV * V, f"{C} conv channels for {n_k} key and {HV} value heads"
    assert a.stride(1) == 1 and b.stride(1) == 1 and o.is_contiguous() and o.shape[1:] == (HV, V) \
        and o.shape[0] >= B * T, f"rows of a and b, and o [>= {B * T}, {HV}, {V}], contiguous"
    assert columns >= 1 and 0 <= t and t + columns <= T, f"columns {t}..{t + columns - 1} of {T}"
    bv = min(BV, V)
    rows = o.shape[0] if t + columns == T else B * T
    _step_kernel[(B * HV, V // bv)](
        win, win.stride(0), win.stride(1), conv_w, a, a.stride(0), b, b.stride(0), A_log, dt_bias,
        s_in, in_idx if in_idx is not None else s_in, s_out, out_idx if out_idx is not None else s_out, o,
        t, t + columns, T, B, B * T, rows, K ** -0.5, HK=n_k, HV=HV, K=K, V=V, KW=KW, BV=bv,
        IN_SLOT=in_idx is not None, OUT_SLOT=out_idx is not None, ACT=False, num_warps=NUM_WARPS)


def conv_window(conv: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, T: int, win: torch.Tensor) -> torch.Tensor:
    """The verify pass's conv windows in one launch: ``win`` ``[B, C, KW - 1 + T]`` (contiguous)
    gets each lane's conv state (``conv`` ``[N, C, KW - 1]``, the lanes' slots ``slots`` ``[B]``
    int64 on the device), then its ``T`` columns' projections (``x`` ``[B * T, C]``, rows at any
    stride, lane-major), as ``torch.cat([conv[slots], x.view(B, T, C).transpose(1, 2)], -1)``
    gives them (copies: the same values). Returns ``win``."""
    B, C, width = win.shape
    KW = conv.shape[2] + 1
    assert width == KW - 1 + T and conv.shape[1] == C and x.shape == (B * T, C), \
        f"window {tuple(win.shape)} for conv states {tuple(conv.shape)}, {T} columns and projections {tuple(x.shape)}"
    assert win.is_contiguous() and conv.stride(2) == 1 and x.stride(1) == 1, \
        "a contiguous window, conv state columns and projection rows contiguous"
    _window_kernel[(B, triton.cdiv(C, CONV_BC))](conv, conv.stride(0), conv.stride(1), slots, x, x.stride(0), win,
                                                 C, T, KW=KW, BC=CONV_BC, num_warps=NUM_WARPS)
    return win


def gdn_decode_step(x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, n_k: int,
                    o: torch.Tensor) -> None:
    """Decode's GDN column for ``L`` lanes in two launches, the conv and recurrent states stepped
    where they lie: ``x`` ``[>= L, C]`` the lanes' pre-conv projections (rows at any stride);
    ``conv`` ``[N, C, KW - 1]`` the conv state slots (the model dtype) and ``state`` ``[N, HV, K,
    V]`` fp32 the recurrent ones, the lanes' in ``slots`` ``[L]`` (int64, on the device); ``a``,
    ``b`` ``[>= L, HV]``. Writes rows ``0..L-1`` of ``o`` ``[R, HV, V]`` (the model dtype) and zeros
    its rows past them (the pass's padding to a row block). The numbers of :func:`gdn_step` on
    the window ``[conv state | x]`` (the verify pass's), bit for bit: the conv's sums run in the
    window's order with the same rounding points."""
    L = slots.shape[0]
    C = x.shape[1]
    HV, K, V = state.shape[1:]
    KW = conv_w.shape[1]
    assert conv.shape[1:] == (C, KW - 1) and conv.stride(2) == 1 and x.stride(1) == 1, \
        "conv state slots [N, C, KW - 1] with contiguous columns, projection rows contiguous"
    assert state.is_contiguous() and state.dtype == torch.float32 and conv_w.is_contiguous(), \
        "fp32 recurrent state slots and the conv weight contiguous"
    assert C == 2 * n_k * K + HV * V and o.is_contiguous() and o.shape[1:] == (HV, V) and o.shape[0] >= L, \
        f"{C} conv channels for {n_k} key and {HV} value heads, o [>= {L}, {HV}, {V}]"
    assert a.stride(1) == 1 and b.stride(1) == 1, "rows of a and b contiguous"
    act = torch.empty(L, C, device=x.device, dtype=o.dtype)
    _conv_step_kernel[(L, triton.cdiv(C, CONV_BC))](x, x.stride(0), conv, conv.stride(0), conv.stride(1), slots,
                                                    conv_w, act, C, KW=KW, BC=CONV_BC, num_warps=NUM_WARPS)
    bv = min(BV, V)
    _step_kernel[(L * HV, V // bv)](
        act, act.stride(0), 1, conv_w, a, a.stride(0), b, b.stride(0), A_log, dt_bias, state, slots, state, slots, o,
        0, 1, 1, L, L, o.shape[0], K ** -0.5, HK=n_k, HV=HV, K=K, V=V, KW=KW, BV=bv, IN_SLOT=True, OUT_SLOT=True, ACT=True,
        num_warps=NUM_WARPS)


def gdn_step_ref(win: torch.Tensor, t: int, conv_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                 n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gdn_step` in torch for one column: ``a``, ``b`` ``[B, HV]``, ``state`` ``[B, HV, K,
    V]`` fp32. Returns ``o`` ``[B, HV, V]`` (``win``'s dtype) and the new state."""
    B, C, _ = win.shape
    HV, K, V = state.shape[1:]
    KW = conv_w.shape[1]
    dt = win.dtype
    x = win[:, :, t:t + KW].float()
    conv = (x * conv_w.float()).sum(-1).to(dt).float()  # [B, C]
    act = F.silu(conv).to(dt).float()
    q, k, v = torch.split(act, [n_k * K, n_k * K, HV * V], dim=-1)
    rep = HV // n_k
    q = q.view(B, n_k, K).repeat_interleave(rep, dim=1)
    k = k.view(B, n_k, K).repeat_interleave(rep, dim=1)
    v = v.view(B, HV, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(b.float()).to(dt).float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    S = state * g.exp()[..., None, None]
    vn = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * vn[..., None, :]
    o = (S * q[..., None]).sum(-2)
    return o.to(dt), S
