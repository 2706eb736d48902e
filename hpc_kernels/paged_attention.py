"""Paged decode attention: one query per lane over that lane's KV pages, read straight from the
pool's planes in the KV profile's format (no dequantised copy of the span, no repeated heads).

Split-K ("flash decoding"): program ``(lane, kv head, split)`` walks its share of the lane's pages
(pages ``[s * per, (s + 1) * per)`` with ``per = ceil(n_pages / SPLITS)``), keeps an online
softmax for the ``rep`` query heads that read this KV head, and writes an unnormalised partial;
a second kernel combines the splits. Every number a lane's result depends on comes from that lane
alone (its table, its length, a fixed ``SPLITS``), so a lane's output never depends on the other
lanes of the batch: decode and the speculative verify pass compute the same bits.

Page tables and lengths are device tensors and the grid depends only on the batch size, so the
kernel can be captured in a CUDA graph whose replays serve every context length.

Pages are read by ``kv_quant_triton.dequant_tile``, the gather kernel's own reader (the same
values), cast to the query's dtype before the dot products, as the gather + SDPA path casts them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant_triton import KIND_IDS, _typed_planes, dequant_tile, hw_fp8

#: splits of a lane's pages (a constant, so a lane's result is independent of the batch)
SPLITS = 16
PAGE = 64


@triton.jit
def _split_kernel(q_ptr, o_ptr, ml_ptr, table_ptr, table_stride, seqlen_ptr,
                  kd_ptr, ks_ptr, vd_ptr, vs_ptr, gs_k, gs_v, qk_scale,
                  H_KV: tl.constexpr, REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                  KIND_K: tl.constexpr, GROUP_K: tl.constexpr, KIND_V: tl.constexpr, GROUP_V: tl.constexpr,
                  SPLITS_C: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HW_FP8: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    H: tl.constexpr = H_KV * REP
    n = tl.load(seqlen_ptr + b).to(tl.int32)
    n_pages = (n + BLOCK_N - 1) // BLOCK_N
    per = (n_pages + SPLITS_C - 1) // SPLITS_C
    p0 = s * per
    p1 = tl.minimum(p0 + per, n_pages)

    r = tl.arange(0, M)
    rmask = r < REP
    head = hk * REP + r
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + head)[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
    dt = q.dtype
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for p in range(p0, p1):
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + p).to(tl.int64)
        valid = p * BLOCK_N + offs < n
        rows = (page * BLOCK_N + offs) * H_KV + hk
        k = dequant_tile(kd_ptr, ks_ptr, rows, valid, gs_k, D, KIND_K, GROUP_K, BLOCK_N, HW_FP8).to(dt)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pe = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pe, axis=1)
        v = dequant_tile(vd_ptr, vs_ptr, rows, valid, gs_v, D, KIND_V, GROUP_V, BLOCK_N, HW_FP8).to(dt)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pe.to(dt), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pe.to(dt), v)
        m_i = m_new
    base = (b * H + head) * SPLITS_C + s  # [M]
    tl.store(o_ptr + base.to(tl.int64)[:, None] * D + d[None, :], acc, mask=rmask[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=rmask)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=rmask)


@triton.jit(do_not_specialize=["valid"])  # a value per lane count: one compilation for all
def _combine_kernel(o_ptr, ml_ptr, out_ptr, valid, D: tl.constexpr, SPLITS_C: tl.constexpr):
    row = tl.program_id(0)  # b * H + head
    d = tl.arange(0, D)
    if row < valid:
        sp = tl.arange(0, SPLITS_C)
        m = tl.load(ml_ptr + (row * SPLITS_C + sp) * 2)
        l = tl.load(ml_ptr + (row * SPLITS_C + sp) * 2 + 1)
        mx = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
        o = tl.load(o_ptr + (row.to(tl.int64) * SPLITS_C + sp)[:, None] * D + d[None, :])
        num = tl.sum(o * w[:, None], axis=0)
        den = tl.sum(l * w, axis=0)
        tl.store(out_ptr + row.to(tl.int64) * D + d, (num / den).to(out_ptr.dtype.element_ty))
    else:  # a padding row of the output (the pass's rows past the lanes'): zeros
        tl.store(out_ptr + row.to(tl.int64) * D + d, tl.zeros([D], dtype=out_ptr.dtype.element_ty))


def supports(fmt_k, fmt_v, head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel handles this pool (formats of the built-in profiles, power-of-two head_dim)."""
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0
    if not pow2(head_dim) or head_dim < 16 or heads % kv_heads:
        return False
    for fmt in (fmt_k, fmt_v):
        if fmt.kind not in KIND_IDS:
            return False
        if fmt.kind in ("int8", "fp8") and not (pow2(fmt.group) and head_dim % fmt.group == 0):
            return False
    return True


def paged_decode_attention(q: torch.Tensor, fmt_k, k_planes, gs_k: float, fmt_v, v_planes, gs_v: float,
                           tables: torch.Tensor, seqlens: torch.Tensor, scale: float,
                           rows: int | None = None) -> torch.Tensor:
    """``q`` ``[B, H, D]``; ``k_planes``/``v_planes``: one side's planes ``[pages, 64, H_kv, bytes]``;
    ``tables`` ``[B, W]`` page ids (int64), ``seqlens`` ``[B]`` keys per lane (position + 1).
    Returns ``[rows, H, D]`` (``rows`` >= B, default B) in ``q``'s dtype, its rows past ``B`` zero
    (a pass's padding to a row block, written by the same launch)."""
    B, H, D = q.shape
    h_kv = k_planes[0].shape[-2]
    rep = H // h_kv
    assert H == rep * h_kv, f"{H} query heads do not group over {h_kv} KV heads"
    assert tables.dim() == 2 and tables.shape[0] == B and seqlens.shape == (B,), "one table row and length per lane"
    q = q.contiguous()
    kd, ks = _typed_planes(fmt_k, [p.view(-1, h_kv, p.shape[-1]) for p in k_planes])
    vd, vs = _typed_planes(fmt_v, [p.view(-1, h_kv, p.shape[-1]) for p in v_planes])
    o = torch.empty(B, H, SPLITS, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, H, SPLITS, 2, dtype=torch.float32, device=q.device)
    m_rows = max(16, triton.next_power_of_2(rep))
    _split_kernel[(B, h_kv, SPLITS)](
        q, o, ml, tables, tables.stride(0), seqlens, kd, ks if ks is not None else kd,
        vd, vs if vs is not None else vd, float(gs_k), float(gs_v), float(scale) * 1.4426950408889634,
        H_KV=h_kv, REP=rep, M=m_rows, D=D, KIND_K=KIND_IDS[fmt_k.kind], GROUP_K=max(fmt_k.group, 1),
        KIND_V=KIND_IDS[fmt_v.kind], GROUP_V=max(fmt_v.group, 1), SPLITS_C=SPLITS, BLOCK_N=PAGE,
        IEEE=q.dtype == torch.float32, HW_FP8=hw_fp8(q.device), num_warps=4 if D <= 128 else 8)
    rows = B if rows is None else rows
    assert rows >= B, f"{rows} output rows for {B} queries"
    out = q.new_empty(rows, H, D)
    _combine_kernel[(rows * H,)](o, ml, out, B * H, D=D, SPLITS_C=SPLITS, num_warps=4)
    return out
