"""Paged prefill attention: a prefill pass's queries over one lane's KV pages, read in place.

A pass of ``T`` new tokens at positions ``[start, start + T)`` has already written its own K/V
into the lane's pages; query ``t`` reads keys ``[0, start + t]`` (causal inside the pass, the
whole cached prefix before it). The pages are read straight from the pool's planes in the KV
profile's format by ``kv_quant_triton.dequant_tile`` (the decode kernel's and the gather's reader,
so every path sees the same stored values), without a dequantised copy of the span, a dense mask
or repeated K/V heads.

Program ``(row block, kv head)`` takes ``M`` consecutive rows of the flattened ``(token, query
head of this kv head)`` grid (``row = t * REP + j``, no rows wasted on a head count that is not a
power of two), loads their queries once and walks the pages up to its last row's position with an
online softmax (exp2, fp32 statistics and accumulator), masking keys past each row's own
position. Lengths are runtime values (``do_not_specialize``), so one compiled kernel per KV
format, head shape and launch configuration (:data:`CONFIGS`) serves every pass.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import triton
import triton.language as tl

from .kv_quant_triton import KIND_IDS, _typed_planes, dequant_tile, hw_fp8

PAGE = 64
#: rows (token x query head pairs) per program, warps and pipeline stages, by (head_dim, tokens
#: of the pass): a pass takes the largest key whose head_dim and tokens are not above its own.
#: Chosen by measurement (``benchmarks/prefill_attention.py``, an H100, the 27B model's 24 query
#: and 4 KV heads of 256, int8-g64 pages): from 512 tokens, 128 rows with 8 warps took 0.81-0.85x
#: the time of 64 rows with 4 (290.6 against 358.3 us for 512 new tokens after 4,096 cached,
#: 284.2 against 343.0 for 2,048 from 0, 710.3 against 839.8 after 2,048), where 256 tokens after
#: 2,048 took 1.07x (146.5 against 136.6 us: half as many programs). The same bits either way: a
#: row's result does not depend on which rows share its program. At head_dim 256 both spill
#: (255 registers a thread), 128 rows with 8 warps less in every KV format (ptxas for sm_90).
#: ``block_n`` (default a page, 64): keys a step of the online softmax; 32 spills a quarter as
#: much at 64 rows (ptxas) but changes the sums' order, so the bits; not yet timed.
CONFIGS = {(0, 0): {"block_m": 64, "num_warps": 4, "num_stages": 2},
           (256, 512): {"block_m": 128, "num_warps": 8, "num_stages": 3}}


def launch_config(head_dim: int, tokens: int) -> dict[str, int]:
    """The launch configuration of :data:`CONFIGS` for a pass of ``tokens`` (padding included)
    at ``head_dim``."""
    return CONFIGS[max(k for k in CONFIGS if k[0] <= head_dim and k[1] <= tokens)]


@contextlib.contextmanager
def every_pass_with(cfg: dict[str, int]) -> Iterator[None]:
    """Within the block every pass runs with ``cfg`` (a benchmark's or a check's sweep), then
    :data:`CONFIGS` is as it was."""
    saved = dict(CONFIGS)
    CONFIGS.clear()
    CONFIGS[(0, 0)] = cfg
    try:
        yield
    finally:
        CONFIGS.clear()
        CONFIGS.update(saved)


@triton.jit(do_not_specialize=["start", "T", "n_rows"])
def _prefill_kernel(q_ptr, o_ptr, table_ptr, start, T, n_rows,  # T: valid tokens (rows past it: padding)
                    kd_ptr, ks_ptr, vd_ptr, vs_ptr, gs_k, gs_v, qk_scale, meta_ptr,
                    H_KV: tl.constexpr, REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                    KIND_K: tl.constexpr, GROUP_K: tl.constexpr, KIND_V: tl.constexpr, GROUP_V: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE_N: tl.constexpr, IEEE: tl.constexpr, HW_FP8: tl.constexpr,
                    META: tl.constexpr):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    if META:  # start and valid rows read from the device (a CUDA graph's pass: no host values baked in)
        start = tl.load(meta_ptr).to(tl.int32)
        T = tl.load(meta_ptr + 1).to(tl.int32)
    H: tl.constexpr = H_KV * REP
    r = pid * M + tl.arange(0, M)  # flat (token, rep) rows
    rmask = r < n_rows
    t = r // REP
    head = hk * REP + r % REP
    qpos = start + tl.minimum(t, T - 1)  # each row's own position: it reads keys [0, qpos]
    d = tl.arange(0, D)
    qoff = (t.to(tl.int64) * H + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qoff, mask=rmask[:, None], other=0.0)
    dt = q.dtype
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    last = start + tl.minimum((pid * M + M - 1) // REP, T - 1)  # the block's deepest position
    # a block of padding rows only reads one key tile: its outputs are dropped, but stay finite
    n_pages = last // BLOCK_N + 1
    if (pid * M) // REP >= T:
        n_pages = 1
    for p in range(0, n_pages):  # key tiles of BLOCK_N, PAGE_N // BLOCK_N of them a page
        page = tl.load(table_ptr + p // (PAGE_N // BLOCK_N)).to(tl.int64)
        kpos = p * BLOCK_N + offs
        kvalid = kpos <= last
        rows = (page * PAGE_N + (p % (PAGE_N // BLOCK_N)) * BLOCK_N + offs) * H_KV + hk
        k = dequant_tile(kd_ptr, ks_ptr, rows, kvalid, gs_k, D, KIND_K, GROUP_K, BLOCK_N, HW_FP8).to(dt)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(kpos[None, :] <= qpos[:, None], sc * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pe = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pe, axis=1)
        v = dequant_tile(vd_ptr, vs_ptr, rows, kvalid, gs_v, D, KIND_V, GROUP_V, BLOCK_N, HW_FP8).to(dt)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pe.to(dt), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pe.to(dt), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + qoff, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_prefill_attention(q: torch.Tensor, fmt_k, k_planes, gs_k: float, fmt_v, v_planes, gs_v: float,
                            table: torch.Tensor, start: int, scale: float, valid: int | None = None,
                            out: torch.Tensor | None = None, meta: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[T, H, D]`` at positions ``start .. start + T - 1`` of one lane; ``table`` ``[P]``
    the lane's page ids (int64, covering position ``start + valid - 1``); ``k_planes``/``v_planes``:
    one side's planes ``[pages, 64, H_kv, bytes]`` of one layer. Returns ``[T, H, D]`` in ``q``'s
    dtype: query ``t`` attends to keys ``[0, start + t]``; rows past ``valid`` (padding, default
    none) read as row ``valid - 1``. ``meta`` (int64 ``[2]`` on the device): ``start`` and ``valid``
    are read from it by the kernel instead (the host values are then not checked), so a CUDA graph
    of the pass serves every start and valid length."""
    T_all, H, D = q.shape
    T = T_all if valid is None else int(valid)
    assert meta is not None or 1 <= T <= T_all, f"valid rows {T} outside [1, {T_all}]"
    h_kv = k_planes[0].shape[-2]
    rep = H // h_kv
    assert H == rep * h_kv, f"{H} query heads do not group over {h_kv} KV heads"
    assert table.dim() == 1 and (meta is not None or table.shape[0] * PAGE >= start + T), \
        f"table of {table.shape[0]} pages does not cover position {start + T - 1}"
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    kd, ks = _typed_planes(fmt_k, [p.view(-1, h_kv, p.shape[-1]) for p in k_planes])
    vd, vs = _typed_planes(fmt_v, [p.view(-1, h_kv, p.shape[-1]) for p in v_planes])
    cfg = launch_config(D, T_all)
    m = int(cfg["block_m"])
    n_rows = T_all * rep
    _prefill_kernel[(triton.cdiv(n_rows, m), h_kv)](
        q, out, table, int(start), T, n_rows, kd, ks if ks is not None else kd, vd, vs if vs is not None else vd,
        float(gs_k), float(gs_v), float(scale) * 1.4426950408889634, meta if meta is not None else table,
        H_KV=h_kv, REP=rep, M=m, D=D, KIND_K=KIND_IDS[fmt_k.kind], GROUP_K=max(fmt_k.group, 1),
        KIND_V=KIND_IDS[fmt_v.kind], GROUP_V=max(fmt_v.group, 1), BLOCK_N=int(cfg.get("block_n", PAGE)), PAGE_N=PAGE,
        IEEE=q.dtype == torch.float32, HW_FP8=hw_fp8(q.device), META=meta is not None,
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    return out
