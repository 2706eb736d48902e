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

import torch
import triton
import triton.language as tl

#: tiles by pass kind: decode-sized blocks of rows, and prefill passes
DECODE_ROWS = 16
TILES = {"decode": {"BM": 16, "BN": 64, "num_warps": 4, "num_stages": 3},
         "prefill": {"BM": 64, "BN": 128, "num_warps": 8, "num_stages": 3}}
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _tile(m: int) -> dict[str, int]:
    return TILES["decode" if m <= DECODE_ROWS else "prefill"]


@triton.jit(do_not_specialize=["M", "N", "K"])
def _fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                SB_N: tl.constexpr, SB_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        kmask = kk < K
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
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


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


@triton.jit(do_not_specialize=["M", "N", "K"])
def _nvfp4_kernel(x_ptr, p_ptr, s_ptr, factor, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_ym,
                  GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  DOT: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rh = tl.arange(0, BK // 2)  # packed bytes of a K step
    rg = tl.arange(0, BK // GROUP)  # groups of a K step
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
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
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _launch(kernel, x: torch.Tensor, n: int, k: int, weights: tuple, weight_strides: tuple, bk: int,
            **meta) -> torch.Tensor:
    """``x [..., K]`` as contiguous rows, ``y [..., N]`` in ``x``'s dtype, and one launch of
    ``kernel`` over the tile the row count picks (``weights``: the kernel's tensors and scalars
    between ``x`` and ``y``)."""
    assert x.shape[-1] == k, f"input has {x.shape[-1]} features, the weight takes {k}"
    assert x.dtype in _DOT_DTYPES, f"quantized matmuls take bf16, fp16 or fp32 inputs, not {x.dtype}"
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m:
        tile = _tile(m)
        grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(n, tile["BN"]))
        kernel[grid](x2, *weights, y, m, n, k, x2.stride(0), *weight_strides, y.stride(0), BM=tile["BM"],
                     BN=tile["BN"], BK=bk, DOT=_DOT_DTYPES[x.dtype], IEEE=x.dtype == torch.float32,
                     num_warps=tile["num_warps"], num_stages=tile["num_stages"], **meta)
    return y.reshape(*x.shape[:-1], n)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x [..., K] @ W^T`` for a block-scaled FP8 ``weight [N, K]`` with float32 ``scale
    [ceil(N / block[0]), ceil(K / block[1])]``."""
    n, k = weight.shape
    sb_n, sb_k = block
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, "fp8 weight, float32 scales"
    assert weight.stride(-1) == 1 and scale.stride(-1) == 1, "weight and scale rows must be contiguous"
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
