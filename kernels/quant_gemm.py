"""Matmuls on quantized weights read in place: ``y = x W^T`` with ``W`` kept as stored.

Two weight formats (``hpc_cli.model.quant_weights`` reads and writes them):

* **FP8 blocks**: ``W`` float8_e4m3fn ``[N, K]`` with one float32 scale per ``SB_N x SB_K`` block
  (``scale [ceil(N / SB_N), ceil(K / SB_K)]``). A program's K step spans part of one scale block,
  so the step's partial product is computed on the fp8 values (exact in bf16) and multiplied by
  its column's block scale in fp32 before it joins the accumulator.
* **NVFP4**: e2m1 codes packed two per byte (``[N, K / 2]``, the even element in the low nibble),
  one float8_e4m3fn scale per ``GROUP`` inputs (``[N, K / GROUP]``) and one global factor. A code
  times its group scale has at most 5 significant bits, exact in bf16 and fp16, so the tile of
  weights the dot reads is exact; the global factor multiplies the fp32 accumulator at the end.

``x`` is ``[M, K]`` in bf16, fp16 or fp32 (fp32 runs the dot in tf32-free IEEE mode), ``y`` is
``[M, N]`` in ``x``'s dtype. ``M``, ``N`` and ``K`` are runtime values (not specialised), so one
compiled kernel per (format, dtype, tile) serves every pass length; the tile depends only on
whether ``M`` is a decode-sized block (<= 16 rows) or a prefill pass, and a row's numbers do not
depend on the other rows of its tile (the engine's decode/verify bit identity relies on that with
a fixed row block).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

#: tiles by pass kind: decode-sized blocks of rows, and prefill passes
DECODE_ROWS = 16
TILES = {"decode": {"BM": 16, "BN": 64, "num_warps": 4, "num_stages": 4, "waves": 4},
         "prefill": {"BM": 64, "BN": 128, "num_warps": 8, "num_stages": 3}}
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _tile(m: int) -> dict[str, int]:
    return TILES["decode" if m <= DECODE_ROWS else "prefill"]


@triton.jit(do_not_specialize=["M", "N", "K", "K_SPLIT"])
def _fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                SB_N: tl.constexpr, SB_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # this program's share of K: [pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * K_SPLIT)
    for k0 in range(pid_k * K_SPLIT, k_end, BK):
        kk = k0 + rk
        kmask = kk < k_end
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0).to(DOT)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0).to(DOT)
        s = tl.load(s_ptr + (rn // SB_N) * stride_sn + k0 // SB_K, mask=nmask, other=0.0)
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))
        acc += part * s[None, :]
    tl.store(y_ptr + pid_k.to(tl.int64) * stride_ys + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["M", "N", "SPLITS"])
def _sum_splits_kernel(p_ptr, y_ptr, M, N, SPLITS, stride_ps, stride_pm, stride_ym, BLOCK: tl.constexpr):
    """``y[m, n] = sum_s p[s, m, n]`` in a fixed order (split 0 first): a row's sum never depends
    on the other rows or on how many there are."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + rn, mask=nmask, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit(do_not_specialize=["M", "K"])
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
def _e2m1(code):
    """e2m1 code (sign in bit 3) -> float32 value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    mag = code & 7
    e = (mag >> 1).to(tl.int32)
    m = (mag & 1).to(tl.float32)
    sub = 0.5 * m  # e == 0: the subnormal pair 0, 0.5
    norm = (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32))
    v = tl.where(e == 0, sub, norm)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit(do_not_specialize=["M", "N", "K", "K_SPLIT"])
def _nvfp4_kernel(x_ptr, p_ptr, s_ptr, factor, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_pn, stride_sn, stride_ym,
                  stride_ys, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  DOT: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rh = tl.arange(0, BK // 2)  # packed bytes of a K step
    rg = tl.arange(0, BK // GROUP)  # groups of a K step
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, tl.minimum(K, (pid_k + 1) * K_SPLIT), BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=mmask[:, None] & (kk < K)[None, :], other=0.0).to(DOT)
        hh = k0 // 2 + rh
        packed = tl.load(p_ptr + rn.to(tl.int64)[:, None] * stride_pn + hh[None, :],
                         mask=nmask[:, None] & (hh < K // 2)[None, :], other=0)
        lo = _e2m1(packed & 15)
        hi = _e2m1(packed >> 4)
        vals = tl.reshape(tl.join(lo, hi), (BN, BK))  # the low nibble is the even element
        gg = k0 // GROUP + rg
        s = tl.load(s_ptr + rn.to(tl.int64)[:, None] * stride_sn + gg[None, :],
                    mask=nmask[:, None] & (gg < K // GROUP)[None, :], other=0.0).to(tl.float32)
        w = tl.reshape(tl.reshape(vals, (BN, BK // GROUP, GROUP)) * s[:, :, None], (BN, BK)).to(DOT)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    acc = acc * factor
    tl.store(y_ptr + pid_k.to(tl.int64) * stride_ys + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


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


def _launch(kernel, x: torch.Tensor, n: int, k: int, weights: tuple, weight_strides: tuple, bk: int,
            **meta) -> torch.Tensor:
    """``x [..., K]`` as contiguous rows, ``y [..., N]`` in ``x``'s dtype, and one launch of
    ``kernel`` over the tile the row count picks (``weights``: the kernel's tensors and scalars
    between ``x`` and ``y``). A decode-sized product splits K over programs (fp32 partial sums,
    then :func:`_sum_splits_kernel` adds them in a fixed order), so that a weight read by one row
    still keeps every multiprocessor loading."""
    assert x.shape[-1] == k, f"input has {x.shape[-1]} features, the weight takes {k}"
    assert x.dtype in _DOT_DTYPES, f"quantized matmuls take bf16, fp16 or fp32 inputs, not {x.dtype}"
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m:
        tile = _tile(m)
        splits, per = k_splits(n, k, tile["BN"], bk, tile.get("waves", 0), sm_count(x.device))
        out = y if splits == 1 else torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
        grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(n, tile["BN"]), splits)
        kernel[grid](x2, *weights, out, m, n, k, per, x2.stride(0), *weight_strides, out.stride(-2),
                     out.stride(0) if splits > 1 else 0, BM=tile["BM"], BN=tile["BN"], BK=bk,
                     DOT=_DOT_DTYPES[x.dtype], IEEE=x.dtype == torch.float32, num_warps=tile["num_warps"],
                     num_stages=tile["num_stages"], **meta)
        if splits > 1:
            _sum_splits_kernel[(m, triton.cdiv(n, 1024))](out, y, m, n, splits, out.stride(0), out.stride(1),
                                                          y.stride(0), BLOCK=1024)
    return y.reshape(*x.shape[:-1], n)


def quantize_rows(x: torch.Tensor, group: int = 128, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 codes ``[rows, K]``, float32 scales ``[rows, K / group]`` in
    column-major layout): one scale per ``group`` inputs of a row (``amax / 448``). ``rows``
    (>= M) pads with zero rows, as cuBLAS's block-scaled product wants a multiple of 4."""
    m, k = x.shape
    rows = m if rows is None else rows
    assert rows >= m and k % group == 0, f"{m} rows into {rows}, {k} inputs in groups of {group}"
    assert x.stride(-1) == 1, "rows must be contiguous"
    q = torch.zeros(rows, k, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.zeros(k // group, rows, device=x.device, dtype=torch.float32)
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
    except Exception:  # an older cuBLAS or GPU: the Triton kernel serves prefill passes instead
        return False


def scales_for_mm(scale: torch.Tensor) -> torch.Tensor:
    """A weight's ``[N / 128, K / 128]`` block scales as cuBLAS's product reads them: K blocks
    padded to a multiple of 4, transposed (a view)."""
    kb = scale.shape[1]
    return F.pad(scale, (0, -kb % 4)).contiguous().t() if kb % 4 else scale.contiguous().t()


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
               mm_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T`` for a block-scaled FP8 ``weight [N, K]`` with float32 ``scale
    [ceil(N / block[0]), ceil(K / block[1])]``. With ``mm_scales`` (:func:`scales_for_mm`) a
    prefill-sized pass of a 128 x 128-block weight on a device that takes it runs as
    :func:`fp8_scaled_mm`; the rest read the weight in the Triton kernel."""
    n, k = weight.shape
    sb_n, sb_k = block
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, "fp8 weight, float32 scales"
    assert weight.stride(-1) == 1 and scale.stride(-1) == 1, "weight and scale rows must be contiguous"
    rows = x.numel() // k if k else 0
    if (mm_scales is not None and rows > DECODE_ROWS and block == (128, 128) and x.dtype != torch.float32
            and n % 16 == 0 and k % 128 == 0 and scaled_mm_ready(x.device)):
        return fp8_scaled_mm(x.reshape(-1, k), weight, mm_scales).reshape(*x.shape[:-1], n)
    bk = min(128, sb_k)  # a K step stays inside one scale block
    assert sb_k % bk == 0 and bk >= 16, f"fp8 scale blocks of {sb_k} inputs are not supported"
    return _launch(_fp8_kernel, x, n, k, (weight, scale), (weight.stride(0), scale.stride(0)), bk,
                   SB_N=sb_n, SB_K=sb_k)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, factor: float,
                 group: int) -> torch.Tensor:
    """``x [..., K] @ W^T`` for NVFP4 ``packed [N, K / 2]`` uint8 with float8_e4m3fn group scales
    ``[N, K / group]`` and the global ``factor`` (the weight is ``e2m1 * scale * factor``)."""
    n, half = packed.shape
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn, "uint8 codes, e4m3 scales"
    assert packed.stride(-1) == 1 and scale.stride(-1) == 1, "code and scale rows must be contiguous"
    bk = 128 if group <= 128 and 128 % group == 0 else group
    assert bk % group == 0 and bk >= 32, f"nvfp4 groups of {group} inputs are not supported"
    return _launch(_nvfp4_kernel, x, n, 2 * half, (packed, scale, float(factor)),
                   (packed.stride(0), scale.stride(0)), bk, GROUP=group)
