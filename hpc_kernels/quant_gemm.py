"""Matmuls on quantized weights: ``y = x W^T`` with ``W`` kept as stored.

Two weight formats (``hpc_cli.model.quant_weights`` reads and writes them):

* **FP8 blocks**: ``W`` float8_e4m3fn ``[N, K]`` with one float32 scale per ``SB_N x SB_K`` block
  (``scale [ceil(N / SB_N), ceil(K / SB_K)]``).
* **NVFP4**: e2m1 codes packed two per byte (``[N, K / 2]``, the even element in the low nibble),
  one float8_e4m3fn scale per ``GROUP`` inputs (``[N, K / GROUP]``) and one global factor.

Two kinds of pass, as their limits differ:

* **Decode-sized** (up to ``DECODE_ROWS`` rows: decode, speculative verify) is bound by reading
  the weight. Each program takes ``BN`` outputs and a share of K for all the rows, and streams
  ``BN x BK`` tiles of codes once. An FP8 weight with bf16/fp16 rows on a device with FP8 matrix
  units is multiplied there as stored: each row's 128 inputs of the step quantized to e4m3
  in the program (``amax / 448``, as the prefill's FP8 product does), the weight tile the
  product's left operand, the fp32 result scaled by the weight's and the row's scales. Otherwise
  the tile, exact in the rows' dtype, meets them on the matrix units (or, a sweep's option, in
  registers). K splits over programs until the device has ``waves`` programs per
  multiprocessor; the last split of an output tile to finish adds the splits' partial sums in a
  fixed order, in the same launch. The splits depend on the
  weight's shape and the device only, and each row runs the same operations whatever the row
  count, so a row's numbers never depend on the other rows (the engine's decode/verify bit
  identity).
* **Prefill-sized** is bound by the matrix units. A 128 x 128-block FP8 weight on a device whose
  cuBLAS takes block scales (Hopper and later, CUDA 12.9+) runs ``F.scaled_mm`` on the FP8 tensor
  cores, the rows quantized to e4m3 per 128 inputs as fine-grained FP8 checkpoints are served.
  Otherwise the pass dequantises the weight into a transient buffer (the numbers of the reference
  dequantisation) and runs cuBLAS's product in the input dtype.

``x`` is ``[..., K]`` in bf16, fp16 or fp32, ``y`` in ``x``'s dtype. A pass's row count is a
runtime value (not specialised); the weight's shapes take Triton's divisibility specialisation
(aligned, vectorised loads), so a model compiles a few variants, all at its warm-up.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kv_quant_triton import e2m1_value
from .split_sums import SplitSums

#: the most rows a pass reads the weight in place for (decode, speculative verify)
DECODE_ROWS = 16
#: tiles: a decode-sized product of each format runs one program per (BN outputs, K split) for
#: all its rows, reading BK inputs a step, on the FP8 matrix units (``e4m3``: the rows quantized
#: per 128 inputs, the weight tile the left operand), on the matrix units in the rows' dtype
#: (``dot``, the weight tile as the left operand when ``swap``) or summed in registers;
#: ``fp8_exact`` is FP8's tile where the rows stay as they are (fp32 rows, a device without FP8
#: matrix units, scale blocks narrower than 128 inputs); a prefill pass's dequantisation writes
#: BN x BK tiles; ``narrow`` is a plain weight of few outputs (:func:`narrow_linear`). Chosen by
#: measurement (``benchmarks/quant_gemm.py --sweep``)
TILES = {"fp8": {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3, "waves": 4, "e4m3": True},
         "fp8_exact": {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 4, "waves": 8, "dot": True},
         "nvfp4": {"BN": 64, "BK": 128, "num_warps": 8, "num_stages": 4, "waves": 8, "dot": True},
         "narrow": {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 3, "waves": 4, "dot": True},
         "prefill": {"BN": 32, "BK": 256, "num_warps": 4}}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sg, GROUP: tl.constexpr):
    """One row's ``GROUP`` inputs -> e4m3 codes and their float32 scale (``amax / 448``), the
    scales stored group-major (``s[g * stride_sg + m]``, the column-major layout cuBLAS takes)."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    rk = g * GROUP + tl.arange(0, GROUP)
    kmask = rk < K
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + rk, mask=kmask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + m.to(tl.int64) * stride_qm + rk, q.to(q_ptr.dtype.element_ty), mask=kmask)
    tl.store(s_ptr + g.to(tl.int64) * stride_sg + m, scale)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, SB_N: tl.constexpr,
                        SB_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A ``BN x BK`` tile of the weight: fp8 times its block scale in fp32, in ``out``'s dtype
    (the numbers of ``dequantize_fp8``)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rn // SB_N)[:, None] * stride_sn + (rk // SB_K)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * stride_on + rk[None, :], (w * s).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(p_ptr, s_ptr, factor, out_ptr, N, K, stride_pn, stride_sn, stride_on, GROUP: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr):
    """A ``BN x BK`` tile of the weight: e2m1 times (group scale times the global factor) in
    fp32, in ``out``'s dtype (the numbers of ``dequantize_nvfp4``)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    hh = k0 // 2 + tl.arange(0, BK // 2)
    gg = k0 // GROUP + tl.arange(0, BK // GROUP)
    rk = k0 + tl.arange(0, BK)
    nmask = rn < N
    packed = tl.load(p_ptr + rn.to(tl.int64)[:, None] * stride_pn + hh[None, :],
                     mask=nmask[:, None] & (2 * hh < K)[None, :], other=0)
    vals = tl.reshape(tl.join(e2m1_value(packed & 15), e2m1_value(packed >> 4)), (BN, BK // GROUP, GROUP))
    s = tl.load(s_ptr + rn.to(tl.int64)[:, None] * stride_sn + gg[None, :],
                mask=nmask[:, None] & (gg * GROUP < K)[None, :], other=0.0).to(tl.float32) * factor
    w = tl.reshape(vals * s[:, :, None], (BN, BK))
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & (rk < K)[None, :])


@triton.jit
def _row_dot(x, w, acc, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """``acc + x w^T`` on the matrix units (``x [BM, BK]``, ``w [BN, BK]`` in ``x``'s dtype):
    ``acc [BM, BN]``, or ``[BN, BM]`` when ``SWAP`` (the weight tile as the product's left
    operand, for wide tiles). fp32 inputs multiply in full precision."""
    if SWAP:
        if IEEE:
            out = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            out = tl.dot(w, tl.trans(x), acc)
    else:
        if IEEE:
            out = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            out = tl.dot(x, tl.trans(w), acc)
    return out


@triton.jit
def _zero_acc(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """A program's fp32 sums: ``[BM rows, BN outputs]``, or ``[BN, BM]`` when ``SWAP``."""
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    return acc


@triton.jit
def _per_output(v, SWAP: tl.constexpr):
    """``v [BN]`` (one value per output) broadcast along the rows of a :func:`_zero_acc` tile."""
    if SWAP:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _add_row(acc, rm, r, row):
    """``acc [BM, BN]`` with ``row [BN]`` added to its row ``r`` (the register-sum tiles)."""
    return tl.where((rm == r)[:, None], acc + row[None, :], acc)


@triton.jit
def _program_share(N, K, K_SPLIT, BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """A rows kernel's program: its row indices, its ``BN`` outputs (and which are real), its
    zeroed sums, and its share of K (``k_begin`` to ``k_end``)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    return (tl.arange(0, BM), rn, rn < N, _zero_acc(BM, BN, SWAP), pid_k * K_SPLIT,
            tl.minimum(K, (pid_k + 1) * K_SPLIT))


@triton.jit
def _finish_rows(y_ptr, p_ptr, lock_ptr, acc, rm, rn, M, N, stride_ym, stride_pm, stride_ps, SPLITS: tl.constexpr,
                 SWAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, REDUCE: tl.constexpr):
    """Rows ``rm < M``, outputs ``rn < N`` of ``acc`` into ``y``. With K split over programs
    (``SPLITS > 1``) each program stores its fp32 partial sums in ``p`` (split ``pid_k``) and
    counts itself in at its outputs' lock; the last program of the ``BN`` outputs to arrive adds
    the splits' partial sums in a fixed order (split 0 first, whoever arrives last), stores the
    sum and resets the lock for the next product (the splits' loads unrolled, so that they are in
    flight together). A row's sum never depends on the other rows, on how many there are or on
    the order the programs ran. Without ``REDUCE`` the partial sums are the output
    (:class:`~hpc_kernels.split_sums.SplitSums`: the kernel that reads it adds them)."""
    if SPLITS == 1:
        _store_tile(y_ptr, acc.to(y_ptr.dtype.element_ty), rm, rn, M, N, stride_ym, SWAP)
    else:
        _store_tile(p_ptr + tl.program_id(1).to(tl.int64) * stride_ps, acc, rm, rn, M, N, stride_pm, SWAP)
        if REDUCE:
            _add_splits(y_ptr, p_ptr, lock_ptr + tl.program_id(0), rm, rn, M, N, stride_ym, stride_pm, stride_ps,
                        SPLITS, BM, BN)


@triton.jit
def _store_tile(base, vals, rm, rn, M, N, stride_m, SWAP: tl.constexpr):
    """Rows ``rm < M``, outputs ``rn < N`` of ``vals`` (``[BM rows, BN outputs]``, or ``[BN, BM]``
    when ``SWAP``) at ``base + row * stride_m + output``."""
    if SWAP:
        tl.store(base + rm.to(tl.int64)[None, :] * stride_m + rn[:, None], vals,
                 mask=(rm < M)[None, :] & (rn < N)[:, None])
    else:
        tl.store(base + rm.to(tl.int64)[:, None] * stride_m + rn[None, :], vals,
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _add_splits(y_ptr, p_ptr, lock_ptr, rm, rn, M, N, stride_ym, stride_pm, stride_ps, SPLITS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    """The program counts itself in at its outputs' lock; the last to arrive adds the splits."""
    tl.debug_barrier()  # every thread's partial sums stored before the program counts itself in
    arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(p_ptr + s * stride_ps + rm[:, None] * stride_pm + rn[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg")
        _store_tile(y_ptr, total.to(y_ptr.dtype.element_ty), rm, rn, M, N, stride_ym, False)
        tl.atomic_xchg(lock_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _fp8_rows_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                     stride_sn, stride_ym, stride_partm, stride_parts, SPLITS: tl.constexpr, REDUCE: tl.constexpr,
                     SB_N: tl.constexpr, SB_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     DOT: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr, E4M3: tl.constexpr):
    """The ``M <= BM`` rows of ``x`` against ``BN`` weight rows over this program's share of K,
    each ``BN x BK`` fp8 tile (within one scale block of inputs) loaded once for all the rows.
    ``E4M3`` (with ``DOT`` and ``SWAP``): the step's ``BK`` inputs (one 128-input group) of every
    row are quantized to e4m3 with the row's own scale (``amax / 448``) and meet the tile on the
    FP8 matrix units, the product scaled by the weight block's and the rows' scales. ``DOT``: the
    tile, exact in ``x``'s dtype, meets the rows on the matrix units and the step's product is
    scaled per weight row; otherwise the tile is scaled in fp32 registers and each row sums its
    products there. Each row runs the same operations whatever ``M``."""
    rm, rn, nmask, acc, k_begin, k_end = _program_share(N, K, K_SPLIT, BM, BN, SWAP)
    rk = tl.arange(0, BK)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + rk
        kmask = kk < k_end
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        s = tl.load(s_ptr + (rn // SB_N) * stride_sn + k0 // SB_K, mask=nmask, other=0.0)
        if E4M3:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            xs = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
            xq = tl.clamp(x / xs[:, None], -448.0, 448.0).to(w.dtype)
            acc += tl.dot(w, tl.trans(xq)) * (s[:, None] * xs[None, :])
        elif DOT:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & kmask[None, :],
                        other=0.0)
            acc += _row_dot(x, w.to(x.dtype), _zero_acc(BM, BN, SWAP), SWAP, IEEE) * _per_output(s, SWAP)
        else:
            wf = w.to(tl.float32) * s[:, None]
            for r in tl.static_range(BM):
                x = tl.load(x_ptr + r * stride_xm + kk, mask=kmask & (tl.full((BK,), r, tl.int32) < M),
                            other=0.0).to(tl.float32)
                acc = _add_row(acc, rm, r, tl.sum(wf * x[None, :], axis=1))
    _finish_rows(y_ptr, part_ptr, lock_ptr, acc, rm, rn, M, N, stride_ym, stride_partm, stride_parts, SPLITS, SWAP, BM,
                 BN, REDUCE)


@triton.jit(do_not_specialize=["M"])
def _nvfp4_rows_kernel(x_ptr, p_ptr, s_ptr, factor, y_ptr, part_ptr, lock_ptr, M, N, K, K_SPLIT, stride_xm,
                       stride_pn, stride_sn, stride_ym, stride_partm, stride_parts, SPLITS: tl.constexpr,
                       REDUCE: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_fp8_rows_kernel` for NVFP4: a step decodes ``BN x BK`` e2m1 codes once, the low
    and the high nibbles apart (the even and the odd inputs), each times its group's e4m3 scale
    (exact in bf16 and fp16), and meets the rows' even and odd inputs with them; the global
    factor multiplies the sums at the end."""
    rm, rn, nmask, acc, k_begin, k_end = _program_share(N, K, K_SPLIT, BM, BN, SWAP)
    rh = tl.arange(0, BK // 2)
    for k0 in range(k_begin, k_end, BK):
        ke = k0 + 2 * rh  # the even inputs (low nibbles); the odd ones are ke + 1
        hmask = nmask[:, None] & (ke < k_end)[None, :]
        packed = tl.load(p_ptr + rn.to(tl.int64)[:, None] * stride_pn + (k0 // 2 + rh)[None, :], mask=hmask, other=0)
        s = tl.load(s_ptr + rn.to(tl.int64)[:, None] * stride_sn + (ke // GROUP)[None, :], mask=hmask,
                    other=0.0).to(tl.float32)
        lo = e2m1_value(packed & 15) * s
        hi = e2m1_value(packed >> 4) * s
        if DOT:
            xmask = (rm < M)[:, None] & (ke < k_end)[None, :]
            xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=xmask, other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1, mask=xmask, other=0.0)
            acc = _row_dot(xo, hi.to(xo.dtype), _row_dot(xe, lo.to(xe.dtype), acc, SWAP, IEEE), SWAP, IEEE)
        else:
            for r in tl.static_range(BM):
                xmask = (ke < k_end) & (tl.full((BK // 2,), r, tl.int32) < M)
                xe = tl.load(x_ptr + r * stride_xm + ke, mask=xmask, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + r * stride_xm + ke + 1, mask=xmask, other=0.0).to(tl.float32)
                acc = _add_row(acc, rm, r, tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1))
    _finish_rows(y_ptr, part_ptr, lock_ptr, acc * factor, rm, rn, M, N, stride_ym, stride_partm, stride_parts, SPLITS,
                 SWAP, BM, BN, REDUCE)


@triton.jit(do_not_specialize=["M"])
def _narrow_rows_kernel(x_ptr, w_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                        stride_partm, stride_parts, SPLITS: tl.constexpr, REDUCE: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_fp8_rows_kernel` for a weight in the rows' own dtype: each ``BN x BK`` tile meets
    the rows on the matrix units."""
    rm, rn, nmask, acc, k_begin, k_end = _program_share(N, K, K_SPLIT, BM, BN, SWAP)
    rk = tl.arange(0, BK)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + rk
        kmask = kk < k_end
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        acc = _row_dot(x, w.to(x.dtype), acc, SWAP, IEEE)
    _finish_rows(y_ptr, part_ptr, lock_ptr, acc, rm, rn, M, N, stride_ym, stride_partm, stride_parts, SPLITS, SWAP, BM,
                 BN, REDUCE)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed 132 off CUDA, where only Triton's
    interpreter runs these kernels, so that its splits are those of an H100/H200)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def k_splits(n: int, k: int, bn: int, bk: int, waves: int, sms: int) -> tuple[int, int]:
    """``(splits, inputs per split)`` for a decode-sized product: enough programs for ``waves``
    of them per multiprocessor, each split a whole number of ``bk`` steps. It depends on the
    weight's shape and the device alone, never on the row count, so decode and verify rows sum in
    the same order."""
    steps = triton.cdiv(k, bk)
    want = max(1, min(steps, triton.cdiv(waves * sms, triton.cdiv(n, bn))))
    per = triton.cdiv(steps, want)
    return triton.cdiv(steps, per), per * bk


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    assert x.shape[-1] == k, f"input has {x.shape[-1]} features, the weight takes {k}"
    assert x.dtype in _DTYPES, f"quantized matmuls take bf16, fp16 or fp32 inputs, not {x.dtype}"
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


#: a product's output tiles each take one lock (a counter of the K splits that have arrived)
LOCKS = 1 << 16
_locks: dict[torch.device, torch.Tensor] = {}


def split_locks(device: torch.device) -> torch.Tensor:
    """The int32 counters, all zero between products, that the K splits of a decode-sized
    product on ``device`` count themselves in at (each product's last program resets its own).
    One set a device: a device's products run one at a time, in one stream (the model's thread,
    eagerly or from its CUDA graphs). Made, and zeroed, at the device's first product, which must
    not be inside a graph capture (the zeroing would run only when the graph does): the loader's
    kernel check and the engine's warm-up run products eagerly first."""
    locks = _locks.get(device)
    if locks is None:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "run a decode-sized quantized product once before capturing a graph (its split counters are made then)"
        locks = _locks[device] = torch.zeros(LOCKS, device=device, dtype=torch.int32)
    return locks


def _rows_product(rows_kernel, tile: dict, x2: torch.Tensor, n: int, k: int, weights: tuple,
                  weight_strides: tuple, meta: dict, bk_limit: int | None = None,
                  unsummed: bool = False) -> "torch.Tensor | SplitSums":
    """``x2 [M, K] @ W^T`` for up to ``DECODE_ROWS`` rows: a program per (``BN`` outputs, K split)
    reads its weight tile once for all the rows, so that a weight read for few rows still keeps
    every multiprocessor loading; the last split of each ``BN`` outputs to finish adds the
    splits' fp32 partial sums in a fixed order (:func:`_finish_rows`), in the same launch. A tile
    on the matrix units always takes ``DECODE_ROWS`` rows (the missing ones zero), so that its
    operations never depend on the row count. ``bk_limit`` bounds the step (FP8: one scale
    block). ``unsummed``: where K splits, the partial sums themselves (:class:`SplitSums`, for a
    kernel that adds them as it reads them)."""
    m = x2.shape[0]
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    if not m:
        return y
    e4m3 = bool(tile.get("e4m3"))  # FP8 only: the FP8 matrix units, the weight tile the left operand
    dot = e4m3 or bool(tile.get("dot"))
    bk = min(tile["BK"], bk_limit) if bk_limit else tile["BK"]
    splits, per = k_splits(n, k, tile["BN"], bk, tile["waves"], sm_count(x2.device))
    tiles = triton.cdiv(n, tile["BN"])
    assert tiles <= LOCKS, f"{n} outputs in tiles of {tile['BN']} exceed the {LOCKS} split locks"
    part = y if splits == 1 else torch.empty(splits, m, n, device=x2.device, dtype=torch.float32)
    reduce = splits > 1 and not unsummed
    rows_kernel[(tiles, splits)](
        x2, *weights, y, part, split_locks(x2.device), m, n, k, per, x2.stride(0), *weight_strides, y.stride(0),
        part.stride(-2), part.stride(0) if splits > 1 else 0, SPLITS=splits, REDUCE=reduce,
        BM=DECODE_ROWS if dot else triton.next_power_of_2(m), BN=tile["BN"], BK=bk, DOT=dot,
        SWAP=e4m3 or (dot and bool(tile.get("swap"))), IEEE=x2.dtype == torch.float32, num_warps=tile["num_warps"],
        num_stages=tile["num_stages"], **meta)
    return SplitSums(part, x2.dtype) if splits > 1 and unsummed else y


def _dequantized(kernel, n: int, k: int, weights: tuple, weight_strides: tuple, dtype: torch.dtype,
                 device: torch.device, meta: dict) -> torch.Tensor:
    """The whole ``[N, K]`` weight in ``dtype``, written by one launch of ``kernel`` (a transient
    buffer: a prefill pass reads it once, in cuBLAS's product)."""
    tile = TILES["prefill"]
    w = torch.empty(n, k, device=device, dtype=dtype)
    kernel[(triton.cdiv(n, tile["BN"]), triton.cdiv(k, tile["BK"]))](
        *weights, w, n, k, *weight_strides, w.stride(0), BN=tile["BN"], BK=tile["BK"], num_warps=tile["num_warps"],
        **meta)
    return w


def quantize_rows(x: torch.Tensor, group: int = 128, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 codes ``[rows, K]``, float32 scales ``[rows, K / group]`` in
    column-major layout): one scale per ``group`` inputs of a row (``amax / 448``). ``rows``
    (>= M) pads with zero rows, as cuBLAS's block-scaled product wants a multiple of 4."""
    m, k = x.shape
    rows = m if rows is None else rows
    assert rows >= m and k % group == 0, f"{m} rows into {rows}, {k} inputs in groups of {group}"
    assert x.stride(-1) == 1, "rows must be contiguous"
    q = torch.empty(rows, k, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(k // group, rows, device=x.device, dtype=torch.float32)
    if rows > m:  # the padding rows: zero codes and scales
        q[m:].view(torch.uint8).zero_()
        s[:, m:].zero_()
    if m:
        _quantize_rows_kernel[(m, k // group)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group)
    return q, s.t()


def scaled_mm_ready(device: torch.device) -> bool:
    """Whether this torch and device run cuBLAS's block-scaled FP8 product (``F.scaled_mm`` with
    1 x 128 activation and 128 x 128 weight scales: Hopper and later, CUDA 12.9+): probed once
    on a small product against the dequantised one."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    return _scaled_mm_probe(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _scaled_mm_probe(index: int) -> bool:
    dev = torch.device("cuda", index)
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(256, 512, device=dev, generator=g)
        x = torch.randn(40, 512, device=dev, generator=g, dtype=torch.bfloat16)
        ws = w.view(2, 128, 4, 128).abs().amax(dim=(1, 3)) / 448.0
        wq = (w / ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        y = fp8_scaled_mm(x, wq, scales_for_mm(ws))
        ref = x.float() @ (wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
        return bool((y.float() - ref).abs().max() <= 5e-2 * ref.abs().max())
    except Exception:  # an older cuBLAS or GPU: prefill passes dequantise for cuBLAS's bf16 product instead
        return False


def scales_for_mm(scale: torch.Tensor) -> torch.Tensor:
    """A weight's ``[N / 128, K / 128]`` block scales as cuBLAS's product reads them: K blocks
    padded to a multiple of 4, transposed (a view)."""
    kb = scale.shape[1]
    return F.pad(scale, (0, -kb % 4)).contiguous().t() if kb % 4 else scale.contiguous().t()


def fp8_matrix_units(device: torch.device) -> bool:
    """Whether ``device`` multiplies e4m3 operands on its matrix units (compute capability 8.9 and
    later). Off CUDA only Triton's interpreter runs these kernels, and it takes the same tiles."""
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_decode_tile(dtype: torch.dtype, block: tuple[int, int], device: torch.device) -> dict:
    """The tile a decode-sized FP8 product of ``dtype`` rows and ``block`` scales runs: the FP8
    matrix units' (``TILES["fp8"]``, rows quantized to e4m3 per 128 inputs) for bf16/fp16 rows,
    scale blocks of whole 128-input groups and a device that has them; ``TILES["fp8_exact"]``
    (the rows as they are) otherwise."""
    tile = TILES["fp8"]
    if tile.get("e4m3") and not (dtype != torch.float32 and block[1] % 128 == 0 and tile["BK"] == 128
                                 and fp8_matrix_units(device)):
        return TILES["fp8_exact"]
    return tile


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, mm_scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` on the FP8 tensor cores: ``x`` quantized to e4m3 per row and 128 inputs
    (as fine-grained FP8 checkpoints are served), ``weight [N, K]`` e4m3 with 128 x 128 block
    scales (``mm_scales`` from :func:`scales_for_mm`), accumulated in fp32 by cuBLAS."""
    m = x.shape[0]
    rows = m + (-m % 4)
    q, s = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), 128, rows)
    y = F.scaled_mm(q, weight.t(), s, F.ScalingType.BlockWise1x128, mm_scales, F.ScalingType.BlockWise128x128,
                    output_dtype=x.dtype)
    return y[:m]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               mm_scales: torch.Tensor | None = None, unsummed: bool = False) -> "torch.Tensor | SplitSums":
    """``x [..., K] @ W^T`` for a block-scaled FP8 ``weight [N, K]`` with float32 ``scale
    [ceil(N / block[0]), ceil(K / block[1])]``. Up to ``DECODE_ROWS`` rows read the weight in
    place (:func:`_fp8_rows_kernel`, on the FP8 matrix units where :func:`fp8_decode_tile` says
    so); a prefill pass of a 128 x 128-block
    weight with ``mm_scales`` (:func:`scales_for_mm`) on a device that takes it runs
    :func:`fp8_scaled_mm`; other prefill passes dequantise the weight and run cuBLAS's product.
    ``unsummed`` (``x`` ``[M, K]``): a decode-sized pass that splits K gives its :class:`SplitSums`."""
    n, k = weight.shape
    sb_n, sb_k = block
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, "fp8 weight, float32 scales"
    assert weight.stride(-1) == 1 and scale.stride(-1) == 1, "weight and scale rows must be contiguous"
    x2 = _rows(x, k)
    tensor_cores = (mm_scales is not None and block == (128, 128) and x.dtype != torch.float32 and n % 16 == 0
                    and k % 128 == 0 and scaled_mm_ready(x.device))
    if x2.shape[0] <= DECODE_ROWS and not (tensor_cores and TILES["fp8"].get("scaled_mm")):
        tile = fp8_decode_tile(x2.dtype, block, x2.device)
        y = _rows_product(_fp8_rows_kernel, tile, x2, n, k, (weight, scale), (weight.stride(0), scale.stride(0)),
                          {"SB_N": sb_n, "SB_K": sb_k, "E4M3": bool(tile.get("e4m3"))}, bk_limit=sb_k,
                          unsummed=unsummed and x.dim() == 2)
        if isinstance(y, SplitSums):
            return y
    elif tensor_cores:
        y = fp8_scaled_mm(x2, weight, mm_scales)
    else:
        w = _dequantized(_fp8_dequant_kernel, n, k, (weight, scale), (weight.stride(0), scale.stride(0)), x.dtype,
                         x.device, {"SB_N": sb_n, "SB_K": sb_k})
        y = F.linear(x2, w)
    return y.reshape(*x.shape[:-1], n)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, factor: float,
                 group: int, unsummed: bool = False) -> "torch.Tensor | SplitSums":
    """``x [..., K] @ W^T`` for NVFP4 ``packed [N, K / 2]`` uint8 with float8_e4m3fn group scales
    ``[N, K / group]`` and the global ``factor`` (the weight is ``e2m1 * scale * factor``). Up to
    ``DECODE_ROWS`` rows read the codes in place (:func:`_nvfp4_rows_kernel`); a prefill pass
    dequantises the weight and runs cuBLAS's product. ``unsummed``: as :func:`fp8_linear`'s."""
    n, half = packed.shape
    k = 2 * half
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn, "uint8 codes, e4m3 scales"
    assert packed.stride(-1) == 1 and scale.stride(-1) == 1, "code and scale rows must be contiguous"
    assert TILES["nvfp4"]["BK"] % group == 0 and TILES["prefill"]["BK"] % group == 0, \
        f"nvfp4 groups of {group} inputs are not supported"
    x2 = _rows(x, k)
    weights, strides = (packed, scale, float(factor)), (packed.stride(0), scale.stride(0))
    if x2.shape[0] <= DECODE_ROWS:
        y = _rows_product(_nvfp4_rows_kernel, TILES["nvfp4"], x2, n, k, weights, strides, {"GROUP": group},
                          unsummed=unsummed and x.dim() == 2)
        if isinstance(y, SplitSums):
            return y
    else:
        y = F.linear(x2, _dequantized(_nvfp4_dequant_kernel, n, k, weights, strides, x.dtype, x.device,
                                      {"GROUP": group}))
    return y.reshape(*x.shape[:-1], n)


#: the most outputs :func:`narrow_linear` takes (wider plain weights run cuBLAS's product)
NARROW_OUTPUTS = 256


def narrow_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W^T`` for up to ``DECODE_ROWS`` rows and a plain ``weight [N, K]`` of at most
    ``NARROW_OUTPUTS`` rows in ``x``'s dtype (a Gated DeltaNet's ``in_proj_b`` and ``in_proj_a``
    beside FP8 projections, 96 rows at the 27B widths): one launch that splits K over the device
    and adds the splits in place, where cuBLAS runs a split-K product and a reduction kernel
    for so narrow a weight; each row's numbers never depend on the other rows."""
    n, k = weight.shape
    assert n <= NARROW_OUTPUTS and weight.dtype == x.dtype and weight.stride(-1) == 1, \
        f"a narrow product takes at most {NARROW_OUTPUTS} contiguous rows in the input's dtype"
    x2 = _rows(x, k)
    assert x2.shape[0] <= DECODE_ROWS, f"a narrow product takes at most {DECODE_ROWS} rows"
    y = _rows_product(_narrow_rows_kernel, TILES["narrow"], x2, n, k, (weight,), (weight.stride(0),), {})
    return y.reshape(*x.shape[:-1], n)
