"""A draft block's attention in one launch: the block's ``T`` columns of queries over the lane's
context K/V, read in place, and non-causally over the block's own K/V.

A block drafter (``hpc_cli.speculative.dflash``) attends from each lane's block to the context
positions below the block's first position and to every column of the block. In torch that is a
gather or an ``index_select`` of the context (DFlash: its BF16 pool through the page table;
DFlash2: the lane's ring, all ``window`` slots), two concatenations with the block's K/V, a mask
built from the positions, the attention and a transpose back: about a dozen launches, over the
whole padded context whatever the lane's position. Here one program per (lane, KV head) reads
the lane's context rows ``j < min(pos, S)`` where they lie, then the block's own ``T`` keys, with
an online softmax; its rows are the ``heads / kv_heads`` query heads of that KV head times the
block's ``T`` columns (grouped queries read their K/V head once, nothing repeated).

Where the context lies is a table of pages: row ``j`` of lane ``b`` is at ``table[b, j // P] *
page_stride + (j % P) * row_stride + head * head_stride``. DFlash's pool is that with ``P`` = 64
and the padded page table; DFlash2's rings are one page a lane (``P`` = the window, the table the
lanes' state slots); a dense ``[B, kv, S, d]`` context is one page a lane too.

A program walks its lane's context alone, so it is meant for contexts up to :data:`MAX_CONTEXT`
rows (DFlash2's window; DFlash's context up to that length); past it :func:`supports` says no and
the caller keeps its gather and ``scaled_dot_product_attention``. :func:`block_attention_ref` is
the torch twin (that path); the kernel runs under Triton's interpreter too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpc_kernels.launch import INTERPRETING, tl, triton

#: context rows one program walks at most
MAX_CONTEXT = 2048
BLOCK_N = 64
NUM_WARPS = 4
#: a lane's context is shared among one program a ``SPLIT_ROWS`` rows of its width, at most
#: ``MAX_SPLITS`` (a second launch combines them): the programs divide the rows below the block
#: evenly, so a short context is walked in a few steps by each
SPLIT_ROWS = 256
MAX_SPLITS = 8


if triton is not None:
    @triton.jit
    def _absorb(qi, k, v, valid, m, l, acc, scale):
        # one tile of keys into the running softmax: scores, the new maxima, the rescaled sums and rows
        s = tl.where(valid[None, :], tl.dot(qi, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(qi.dtype), v)

    @triton.jit
    def _block_kernel(q, sq, sqh, kb, vb, sk, sv, kc, vc, table, st, pos, sp, out, part, H, T, S, P, s_page, s_row,
                      s_head, scale, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, TP: tl.constexpr,
                      BLOCK_N: tl.constexpr, F32: tl.constexpr, ONE_PAGE: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        # query rows: column t = i // G, query head h * G + i % G
        i = tl.arange(0, ROWS)
        t = i // G
        head = h * G + i % G
        mq = t < T
        od = tl.arange(0, D)
        qi = tl.load(q + (b * T + t)[:, None] * sq + head[:, None] * sqh + od[None, :], mask=mq[:, None], other=0.0)
        if F32:  # Triton's interpreter multiplies bf16 tiles wrongly: its tests run the products in fp32
            qi = qi.to(tl.float32)
        dt = qi.dtype
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        L = tl.minimum(tl.load(pos + b * sp), S)
        lane = tl.load(table + b * st).to(tl.int64) * s_page + h * s_head  # a lane's one page (ONE_PAGE)
        steps = tl.cdiv(L, BLOCK_N)
        per = tl.cdiv(steps, SPLITS)  # a split's share of the steps (SPLITS > 1: a second launch combines them)
        for j0 in range(split * per * BLOCK_N, tl.minimum(split * per + per, steps) * BLOCK_N, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            mj = j < L
            if ONE_PAGE:  # the rows' places need no table read (a ring: the lane's page holds every row)
                row = lane + j.to(tl.int64) * s_row
            else:
                page = tl.load(table + b * st + j // P, mask=mj, other=0).to(tl.int64)
                row = page * s_page + (j % P).to(tl.int64) * s_row + h * s_head
            k = tl.load(kc + row[:, None] + od[None, :], mask=mj[:, None], other=0.0).to(dt)
            v = tl.load(vc + row[:, None] + od[None, :], mask=mj[:, None], other=0.0).to(dt)
            m, l, acc = _absorb(qi, k, v, mj, m, l, acc, scale)
        # the block's own columns, every one to every query of the lane (the last split's)
        if split == SPLITS - 1:
            c = tl.arange(0, TP)
            mc = c < T
            k = tl.load(kb + (b * T + c)[:, None] * sk + h * D + od[None, :], mask=mc[:, None], other=0.0).to(dt)
            v = tl.load(vb + (b * T + c)[:, None] * sv + h * D + od[None, :], mask=mc[:, None], other=0.0).to(dt)
            m, l, acc = _absorb(qi, k, v, mc, m, l, acc, scale)
        if SPLITS == 1:
            o = acc / l[:, None]
            tl.store(out + ((b * T + t) * H + head)[:, None] * D + od[None, :], o.to(out.dtype.element_ty),
                     mask=mq[:, None])
        else:  # this split's unnormalised rows, its maxima and sums: [B, KV, SPLITS, ROWS, D + 2]
            base = part + (((b * tl.num_programs(1) + h) * SPLITS + split) * ROWS + i) * (D + 2)
            tl.store(base[:, None] + od[None, :], acc)
            tl.store(base + D, m)
            tl.store(base + D + 1, l)

    @triton.jit
    def _combine_kernel(part, out, H, T, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                        SPLITS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, ROWS)
        t = i // G
        head = h * G + i % G
        od = tl.arange(0, D)
        base = part + ((b * tl.num_programs(1) + h) * SPLITS * ROWS + i) * (D + 2)
        top = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(base + sp * ROWS * (D + 2) + D))
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            row = base + sp * ROWS * (D + 2)
            w = tl.exp(tl.load(row + D) - top)  # an empty split: m = -inf, weight 0
            l += w * tl.load(row + D + 1)
            acc += w[:, None] * tl.load(row[:, None] + od[None, :])
        tl.store(out + ((b * T + t) * H + head)[:, None] * D + od[None, :], (acc / l[:, None]).to(out.dtype.element_ty),
                 mask=(t < T)[:, None])


def supports(context_rows: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a context of ``context_rows`` rows (the padded width) at
    ``head_dim`` in ``dtype``."""
    return (triton is not None and context_rows <= MAX_CONTEXT and dtype in (torch.bfloat16, torch.float16)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def block_attention(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                    table: torch.Tensor, rows_per_page: int, pos: torch.Tensor, context_rows: int,
                    block_n: int = BLOCK_N, num_warps: int = NUM_WARPS, splits: int | None = None) -> torch.Tensor:
    """The block's attention ``[B * T, heads, d]``: ``q`` ``[B * T, heads, d]`` (lane-major
    columns), the block's ``kb``, ``vb`` ``[B * T, kv, d]`` (any token stride), the context ``kc``,
    ``vc`` (the pages, ``[pages, rows_per_page, kv, d]`` at any page and row strides, the same
    strides both),
    ``table`` ``[B, W]`` (the lanes' pages), ``pos`` ``[B]`` (each lane reads context rows below it),
    ``context_rows`` the rows the table spans (``W * rows_per_page``; fewer where a page holds a
    whole ring). ``block_n``, ``num_warps``, ``splits``: the launch (context rows a step, warps a program,
    programs a lane's context is shared among: by default one a :data:`SPLIT_ROWS` rows, at most
    :data:`MAX_SPLITS`)."""
    N, Hq, D = q.shape
    B = pos.shape[0]
    KV = kb.shape[1]
    assert N % B == 0 and Hq % KV == 0, f"q {tuple(q.shape)}, kb {tuple(kb.shape)}, {B} lanes"
    assert supports(context_rows, D, q.dtype) and kc.dtype == q.dtype == kb.dtype, "outside the kernel"
    assert kc.stride() == vc.stride() and kc.stride(-1) == 1 and kb.stride(-1) == 1 and vb.stride(-1) == 1
    assert kb.stride(1) == D and vb.stride(1) == D, "the block's heads adjacent"
    T, G = N // B, Hq // KV
    out = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    qh = q if q.stride(-1) == 1 else q.contiguous()
    rows = max(16, triton.next_power_of_2(G * T))
    splits = min(MAX_SPLITS, triton.cdiv(context_rows, SPLIT_ROWS)) if splits is None else splits
    part = torch.empty(B, KV, splits, rows, D + 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    _block_kernel[(B, KV, splits)](qh, qh.stride(0), qh.stride(1), kb, vb, kb.stride(0), vb.stride(0), kc, vc,
                                   table, table.stride(0), pos, pos.stride(0), out, part, Hq, T, context_rows,
                                   rows_per_page, kc.stride(0), kc.stride(1), kc.stride(2), 1 / math.sqrt(D), G=G, D=D,
                                   ROWS=rows, TP=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n, F32=INTERPRETING,
                                   ONE_PAGE=context_rows <= rows_per_page, SPLITS=splits, num_warps=num_warps)
    if splits > 1:
        _combine_kernel[(B, KV)](part, out, Hq, T, G=G, D=D, ROWS=rows, SPLITS=splits, num_warps=num_warps)
    return out


def gather_context(pages: torch.Tensor, table: torch.Tensor, rows: int) -> torch.Tensor:
    """Each lane's first ``rows`` context rows ``[B, rows, kv, d]``, copied from ``pages`` ``[pages,
    rows_per_page, kv, d]`` through ``table`` ``[B, W]`` (a page a lane: its first rows alone)."""
    if table.shape[1] == 1:
        assert rows <= pages.shape[1], f"{rows} rows from one page of {pages.shape[1]}"
        return pages[:, :rows].index_select(0, table[:, 0])
    return pages[table].flatten(1, 2)[:, :rows]


def block_attention_ref(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        table: torch.Tensor, rows_per_page: int, pos: torch.Tensor, context_rows: int) -> torch.Tensor:
    """:func:`block_attention`'s torch twin: the context gathered dense, masked below each lane's
    position, concatenated with the block's, one ``scaled_dot_product_attention``."""
    N, Hq, D = q.shape
    B, KV = pos.shape[0], kb.shape[1]
    T = N // B
    assert kc.shape[1] == rows_per_page, f"pages of {kc.shape[1]} rows, told {rows_per_page}"
    ctx_k = gather_context(kc, table, context_rows).to(q.dtype)  # [B, S, KV, D]
    ctx_v = gather_context(vc, table, context_rows).to(q.dtype)
    rows = torch.arange(context_rows, device=q.device)
    keys = torch.cat([ctx_k, kb.reshape(B, T, KV, D)], 1).transpose(1, 2)
    vals = torch.cat([ctx_v, vb.reshape(B, T, KV, D)], 1).transpose(1, 2)
    cols = torch.cat([rows, torch.full((T,), -1, dtype=rows.dtype, device=rows.device)])
    mask = (cols[None] < pos[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.reshape(B, T, Hq, D).transpose(1, 2), keys, vals, attn_mask=mask,
                                       enable_gqa=Hq > KV)
    return o.transpose(1, 2).reshape(N, Hq, D)
