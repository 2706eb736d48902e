"""The chunked gated delta rule's state recurrence, with the state taken at tap positions inside
a chunk (spec §7.2-7.3: a tap costs no prefill split).

The chunked rule walks a sequence in chunks of ``BT = 64`` rows. Entering chunk ``c`` with the
fp32 state ``S`` (``[K, V]`` per value head), it

* keeps ``S`` as the chunk's state ``h[c]`` (in the inputs' dtype, for the output kernel),
* forms the chunk's new values ``v' = u - w @ S`` (``w``, ``u``: the chunk's WY representation),
* and leaves the chunk with ``S * 2^G[e] + k^T @ (v' * 2^(G[e] - G))``, ``e`` the chunk's last row
  and ``G`` the gate's chunk-local cumulative sum in log2 units.

The state after the first ``r`` rows of the chunk (``0 < r <= 64``) is the same expression with
``e = r - 1`` and the rows from ``r`` on left out: the chunk-local WY representation is
lower-triangular, so rows before ``r`` do not depend on the rows after. That is what a call on the
sequence truncated at the tap computes for its last (partial) chunk, in the same operations, so a
tap equals that call's final state bit for bit, and the grid stays where it is: the pass runs the
same kernels over the same rows as with no tap (one launch, no identity rows), and each tap adds
one masked chunk update in the program that owns it, its fp32 state written straight into the
state slot named for it (streaming stores: the state is not read again in this pass).

``taps`` (``[S]`` int64 on the device, offsets in the sequence, ``0`` for a slot not used) and
their destination slots ``dst`` are read by the kernel, so one compiled kernel and one CUDA graph
serve every placement. The entering state is read from, and the final state written to, a slot
of a slot-indexed tensor (the slot read on the device too): a pass reads and writes the lane's
state slot in place, with no gather or scatter of the state around the kernel.
:func:`state_taps_ref` is the torch twin (the same rounding points), used where Triton is not.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton: the torch twin only
    triton = None

CHUNK = 64
#: launch configuration (the value-column tile and warps): fla's own for this kernel's shape on
#: an H200, which keeps the per-chunk states and new values equal to fla's call bit for bit
BV = 32
NUM_WARPS = 4
NUM_STAGES = 2
#: key head dims the kernel takes (one or two 64-row state blocks)
MAX_K = 128


def supported(key_dim: int) -> bool:
    """Whether the kernel takes this key head dim (Triton present, ``K <= 128``)."""
    return triton is not None and 0 < key_dim <= MAX_K


if triton is not None:
    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        """``acc + a @ b``; ``F32``: in fp32 (Triton's interpreter multiplies a tensor converted
        to bf16 in registers as raw bits; the values are the same, rounded to bf16 first)."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @triton.jit
    def _chunk_tap(k_rows, m_k, m_take, b_vt, b_h, scale, F32: tl.constexpr):
        """One state block after a chunk's first rows: ``b_h * scale + k^T @ b_vt`` over the
        taken rows (``m_take``; ``b_vt`` is zero past them)."""
        b_k = tl.load(k_rows, mask=m_k[:, None] & m_take[None, :], other=0.0)
        return _dot(b_k, b_vt, b_h * scale, F32)

    @triton.jit(do_not_specialize=["T"])
    def _state_taps_kernel(k, u, w, g, h, v_new, h0, h0_slot, ht, ht_slot, taps, dst, tap_out, T,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BV: tl.constexpr, SLOTS: tl.constexpr, SP: tl.constexpr,
                           F32: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        nv = tl.cdiv(V, BV)
        i_v, i_h = pid % nv, pid // nv
        n_chunks = tl.cdiv(T, BT)
        KV = K * V
        # per value head: k is shared by HV // H value heads
        k += (i_h // (HV // H)) * K
        u += i_h * V
        w += i_h * K
        v_new += i_h * V
        g += i_h
        h += i_h * KV
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_k1 = tl.arange(0, 64)
        m_k1 = o_k1 < K
        o_k2 = 64 + o_k1
        m_k2 = o_k2 < K
        state1 = o_k1[:, None] * V + o_v[None, :]
        state2 = o_k2[:, None] * V + o_v[None, :]
        m_s1 = m_k1[:, None] & m_v[None, :]
        m_s2 = m_k2[:, None] & m_v[None, :]
        h0 += tl.load(h0_slot) * HV * KV + i_h * KV
        b_h1 = tl.load(h0 + state1, mask=m_s1, other=0.0).to(tl.float32)
        if K > 64:
            b_h2 = tl.load(h0 + state2, mask=m_s2, other=0.0).to(tl.float32)
        if SLOTS > 0:  # the taps' offsets and slots, once, into registers
            o_s = tl.arange(0, SP)
            b_taps = tl.load(taps + o_s, mask=o_s < SLOTS, other=0)
            b_dst = tl.load(dst + o_s, mask=o_s < SLOTS, other=0)
        zero = pid * 0  # an int64 zero: chunk offsets pass 2^31 at the 27B widths
        for c in range(n_chunks):
            c64 = zero + c
            row0 = c64 * BT
            o_t = row0 + tl.arange(0, BT)
            m_t = o_t < T
            # the state entering the chunk, for the output kernel
            h_c = h + c64 * HV * KV
            tl.store(h_c + state1, b_h1.to(h_c.dtype.element_ty), mask=m_s1)
            if K > 64:
                tl.store(h_c + state2, b_h2.to(h_c.dtype.element_ty), mask=m_s2)
            # the chunk's new values: v' = u - w @ S
            b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_v = _dot(b_w, b_h1.to(b_w.dtype), tl.zeros([BT, BV], dtype=tl.float32), F32)
            if K > 64:
                b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                              other=0.0)
                b_v = _dot(b_w, b_h2.to(b_w.dtype), b_v, F32)
            m_tv = m_t[:, None] & m_v[None, :]
            b_v = tl.load(u + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0) - b_v
            tl.store(v_new + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_tv)
            b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
            k_rows1 = k + o_k1[:, None] + o_t[None, :] * (H * K)
            k_rows2 = k + o_k2[:, None] + o_t[None, :] * (H * K)
            # taps inside this chunk: the state after its first r rows (offsets and slots from
            # registers: no memory read on the chunk loop's path unless a tap falls here)
            if SLOTS > 0:
                for j in tl.static_range(SLOTS):
                    p = tl.sum(tl.where(o_s == j, b_taps, 0), 0)
                    if (p > row0) & (p <= row0 + BT):
                        g_tap = tl.load(g + (p - 1) * HV).to(tl.float32)
                        m_take = o_t < p
                        b_vt = (b_v * tl.where(m_take, tl.exp2(g_tap - b_g), 0)[:, None]).to(k.dtype.element_ty)
                        scale = tl.exp2(g_tap)
                        out = tap_out + tl.sum(tl.where(o_s == j, b_dst, 0), 0) * HV * KV + i_h * KV
                        tl.store(out + state1, _chunk_tap(k_rows1, m_k1, m_take, b_vt, b_h1, scale, F32),
                                 mask=m_s1, cache_modifier=".cs")
                        if K > 64:
                            tl.store(out + state2, _chunk_tap(k_rows2, m_k2, m_take, b_vt, b_h2, scale, F32),
                                     mask=m_s2, cache_modifier=".cs")
            # leave the chunk
            g_last = tl.load(g + (tl.minimum(row0 + BT, T) - 1) * HV).to(tl.float32)
            b_v = (b_v * tl.where(m_t, tl.exp2(g_last - b_g), 0)[:, None]).to(k.dtype.element_ty)
            decay = tl.exp2(g_last)
            b_h1 *= decay
            b_k = tl.load(k_rows1, mask=m_k1[:, None] & m_t[None, :], other=0.0)
            b_h1 = _dot(b_k, b_v, b_h1, F32)
            if K > 64:
                b_h2 *= decay
                b_k = tl.load(k_rows2, mask=m_k2[:, None] & m_t[None, :], other=0.0)
                b_h2 = _dot(b_k, b_v, b_h2, F32)
        ht += tl.load(ht_slot) * HV * KV + i_h * KV  # this program's part of the slot: read it only above
        tl.store(ht + state1, b_h1, mask=m_s1)
        if K > 64:
            tl.store(ht + state2, b_h2, mask=m_s2)


def state_taps(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, states: torch.Tensor,
               slot: torch.Tensor, taps: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence. ``k`` ``[1, T, H, K]``, ``w`` ``[1, T, HV, K]``, ``u``
    ``[1, T, HV, V]`` (the WY representation), ``g`` ``[1, T, HV]`` fp32 (chunk-local cumulative
    gate, log2 units); ``states`` ``[N, HV, K, V]`` fp32, slot-indexed (a GDN layer's state
    slots): the entering state is ``states[slot]`` (``slot`` ``[1]`` int64 on the device) and the
    final state goes back there, in place; ``taps`` ``[S]`` int64 (offsets in ``(0, T]``, ``0`` =
    unused) and ``dst`` ``[S]`` int64: tap ``j``'s state goes to ``states[dst[j]]`` (never
    ``slot``). Returns ``h`` ``[1, NT, HV, K, V]`` (each chunk's entering state, in ``k``'s dtype)
    and ``v_new`` (like ``u``). Triton where present (no host value read), else the torch twin."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    S = taps.shape[0]
    assert B == 1, "the tap recurrence runs one sequence"
    assert dst.shape == (S,), f"{S} taps with {tuple(dst.shape)} destinations"
    assert states.shape[1:] == (HV, K, V) and states.dtype == torch.float32 and states.is_contiguous(), \
        f"states {tuple(states.shape)} {states.dtype}, want [N, {HV}, {K}, {V}] float32, contiguous"
    if triton is None or (k.device.type != "cuda" and not _interpreting()):
        return state_taps_ref(k, w, u, g, states, slot, taps, dst)
    assert supported(K), f"key head dim {K} > {MAX_K}"
    for x in (k, w, u, g):
        assert x.is_contiguous(), "the tap recurrence reads contiguous inputs"
    n_chunks = -(-T // CHUNK)
    h = k.new_empty(1, n_chunks, HV, K, V)
    v_new = torch.empty_like(u)
    grid = (-(-V // BV) * HV,)
    # the kernel reads the entering state, writes the final state and the taps through three
    # pointers; here all three are the one slot-indexed tensor
    _state_taps_kernel[grid](k, u, w, g, h, v_new, states, slot, states, slot, taps, dst, states, T,
                             H=H, HV=HV, K=K, V=V, BT=CHUNK, BV=BV, SLOTS=S, SP=triton.next_power_of_2(max(S, 1)),
                             F32=_interpreting(),
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return h, v_new


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def state_taps_ref(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, states: torch.Tensor,
                   slot: torch.Tensor, taps: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`state_taps` in torch: the same steps and rounding points (the state rounded to the
    inputs' dtype before ``w @ S``, the gated new values before ``k^T @ v'``), fp32 sums."""
    _, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    dt = k.dtype
    rep = HV // H
    n_chunks = -(-T // CHUNK)
    kk = k[0].repeat_interleave(rep, dim=1).transpose(0, 1).float()  # [HV, T, K]
    ww, uu = w[0].transpose(0, 1).float(), u[0].transpose(0, 1).float()  # [HV, T, *]
    gg = g[0].transpose(0, 1).float()  # [HV, T]
    S = states[int(slot[0])].float().clone()
    h = k.new_empty(1, n_chunks, HV, K, V)
    v_new = torch.empty_like(u)
    offsets = [int(p) for p in taps.tolist()]
    slots = [int(d) for d in dst.tolist()]
    for c in range(n_chunks):
        a, b = c * CHUNK, min(T, (c + 1) * CHUNK)
        h[0, c] = S.to(dt)
        v = uu[:, a:b] - ww[:, a:b].to(dt).float() @ S.to(dt).float()
        v_new[0, a:b] = v.transpose(0, 1).to(v_new.dtype)
        gc = gg[:, a:b]
        for p, d in zip(offsets, slots):
            if a < p <= a + CHUNK:
                r = p - a
                vt = (v[:, :r] * torch.exp2(gc[:, r - 1:r] - gc[:, :r])[..., None]).to(dt).float()
                states[d] = S * torch.exp2(gc[:, r - 1])[:, None, None] + kk[:, a:a + r].transpose(1, 2) @ vt
        vt = (v * torch.exp2(gc[:, -1:] - gc)[..., None]).to(dt).float()
        S = S * torch.exp2(gc[:, -1])[:, None, None] + kk[:, a:b].transpose(1, 2) @ vt
    states[int(slot[0])] = S
    return h, v_new
