"""Triton twins of ``kv_quant_ref``: quantise new K/V straight into paged storage through a slot
mapping, and dequantise slots for attention.

Bit-exactness with the torch reference comes from doing the same IEEE operations in the same
order: divisions are ``div_rn`` (Triton's ``/`` is an approximate division), float -> fp16 and
fp32 -> bf16 casts round to nearest even as torch's do, half-to-even rounding is done with
``floor`` and an exact fraction test, and the E4M3/E2M1 codes are assembled with integer
arithmetic from values that are already exactly representable (see ``e4m3_round_arith``).

Rows are (token, KV head) pairs; a program takes ``BLOCK_R`` rows of ``D`` values. A negative
slot skips its token (padding). The pool planes are ``uint8`` ``[slots, H, plane_bytes]``
contiguous; scale planes of fp16 scales are passed viewed as ``float16``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant_ref import BF16_MAX, FLT_MAX, SideFormat

KIND_IDS = {"bf16": 0, "int8": 1, "fp8": 2, "nvfp4": 3}
BF16_LIM: tl.constexpr = tl.constexpr(BF16_MAX)
FLT_LIM: tl.constexpr = tl.constexpr(FLT_MAX)


@triton.jit
def _rne(v):
    """Round half to even, exactly (``floor(v + 0.5)`` would be wrong for v just below 0.5)."""
    r = tl.floor(v)
    frac = v - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _e4m3_code(v):
    """|v| <= 448 (fp32) -> (uint8-valued int32 E4M3FN code, its fp32 value), nearest even."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    qe = tl.maximum(e, -6) - 3
    inv_q = ((127 - qe) << 23).to(tl.float32, bitcast=True)
    q = ((127 + qe) << 23).to(tl.float32, bitcast=True)
    val = _rne(a * inv_q) * q  # exact
    bits = val.to(tl.int32, bitcast=True)
    code = tl.where(val >= 0.015625, ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7),
                    (val * 512.0).to(tl.int32))
    code = tl.where((v < 0.0) & (code != 0), code | 0x80, code)
    return code, tl.where(v < 0.0, -val, val)


@triton.jit
def _e4m3_value(c):
    """uint8/int32 E4M3FN code -> fp32 value."""
    c = c.to(tl.int32)
    ex = (c >> 3) & 0xF
    m = c & 7
    normal = (((ex + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_code(v):
    """|v| <= 6 (fp32) -> 4-bit E2M1 code (int32), nearest even."""
    a = tl.abs(v)
    inv_q = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))  # 1 / quantum, exact
    r = _rne(a * inv_q).to(tl.int32)
    idx = tl.where(inv_q == 2.0, r, tl.where(inv_q == 1.0, r + 2, r + 4))
    return tl.where((v < 0.0) & (idx != 0), idx | 8, idx)


@triton.jit
def _e2m1_value(c):
    idx = c & 7
    f = idx.to(tl.float32)
    mag = tl.where(idx < 4, f * 0.5, tl.where(idx < 6, f - 2.0, (f - 4.0) * 2.0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _count_and_clean(x, cnt_ptr, lim, COUNT: tl.constexpr):
    """Add the number of non-finite values to ``*cnt_ptr``; NaN -> 0, clamp to +-lim."""
    if COUNT:
        bad = ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
        nbad = tl.sum(tl.sum(bad, axis=1), axis=0)
        tl.atomic_add(cnt_ptr, nbad, mask=nbad > 0)
    x = tl.where(x != x, 0.0, x)
    return tl.minimum(tl.maximum(x, -lim), lim)


@triton.jit
def _quant_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, n_rows,
                  H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_R: tl.constexpr, COUNT: tl.constexpr):
    """bf16 (KIND 0), int8 (1) and fp8 (2) with one fp16 scale per GROUP values."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    n = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + n, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0)
    orow = slot * H + h  # row in the flat plane
    d = tl.arange(0, D)
    x = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + d[None, :] * sxd,
                mask=ok[:, None], other=0.0).to(tl.float32)
    if KIND == 0:
        x = _count_and_clean(x, cnt_ptr, BF16_LIM, COUNT)
        tl.store(data_ptr + orow[:, None] * D + d[None, :], x.to(tl.bfloat16), mask=ok[:, None])
    else:
        x = _count_and_clean(x, cnt_ptr, FLT_LIM, COUNT)
        NG: tl.constexpr = D // GROUP
        if NG == 1:
            amax = tl.max(tl.abs(x), axis=1)
        else:
            xg = tl.reshape(x, (BLOCK_R, NG, GROUP))
            amax = tl.max(tl.abs(xg), axis=2)
        if KIND == 1:
            s = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
        else:
            s = tl.minimum(tl.math.div_rn(amax, 448.0), 65504.0).to(tl.float16)
        if NG == 1:
            sf = s.to(tl.float32)[:, None]
            xv = x
        else:
            sf = s.to(tl.float32)[:, :, None]
            xv = xg
        pos = sf > 0.0
        v = tl.where(pos, tl.math.div_rn(xv, tl.where(pos, sf, 1.0)), 0.0)
        if KIND == 1:
            q = _rne(tl.minimum(tl.maximum(v, -127.0), 127.0)).to(tl.int8)
        else:
            c, _ = _e4m3_code(tl.minimum(tl.maximum(v, -448.0), 448.0))
            q = c.to(tl.uint8)
        if NG != 1:
            q = tl.reshape(q, (BLOCK_R, D))
        tl.store(data_ptr + orow[:, None] * D + d[None, :], q, mask=ok[:, None])
        if NG == 1:
            tl.store(scale_ptr + orow, s, mask=ok)
        else:
            g = tl.arange(0, NG)
            tl.store(scale_ptr + orow[:, None] * NG + g[None, :], s, mask=ok[:, None])


@triton.jit
def _quant_nvfp4_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, gs, n_rows,
                        H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, COUNT: tl.constexpr,
                        PAIRED: tl.constexpr):
    """NVFP4-G16. PAIRED: ``x_ptr`` is bf16 input viewed as int32 (one even/odd pair per word,
    strides in words), so the pairs split with two shifts instead of a register shuffle."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    n = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + n, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0)
    orow = slot * H + h
    i = tl.arange(0, D // 2)
    if PAIRED:
        w = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + i[None, :], mask=ok[:, None], other=0)
        xe = (w << 16).to(tl.float32, bitcast=True)
        xo = (w & -65536).to(tl.float32, bitcast=True)
    else:
        base = x_ptr + n[:, None] * sxn + h[:, None] * sxh + (2 * i)[None, :] * sxd
        xe = tl.load(base, mask=ok[:, None], other=0.0).to(tl.float32)
        xo = tl.load(base + sxd, mask=ok[:, None], other=0.0).to(tl.float32)
    xe = tl.reshape(_count_and_clean(xe, cnt_ptr, FLT_LIM, COUNT), (BLOCK_R, D // 16, 8))
    xo = tl.reshape(_count_and_clean(xo, cnt_ptr, FLT_LIM, COUNT), (BLOCK_R, D // 16, 8))
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))
    ratio = tl.minimum(tl.math.div_rn(amax, gs * 6.0), 448.0)
    bcode, bval = _e4m3_code(ratio)
    eff = (bval * gs)[:, :, None]
    pos = eff > 0.0
    safe = tl.where(pos, eff, 1.0)
    ve = tl.where(pos, tl.math.div_rn(xe, safe), 0.0)
    vo = tl.where(pos, tl.math.div_rn(xo, safe), 0.0)
    ce = _e2m1_code(tl.minimum(tl.maximum(ve, -6.0), 6.0))
    co = _e2m1_code(tl.minimum(tl.maximum(vo, -6.0), 6.0))
    byte = tl.reshape(ce | (co << 4), (BLOCK_R, D // 2)).to(tl.uint8)
    tl.store(data_ptr + orow[:, None] * (D // 2) + i[None, :], byte, mask=ok[:, None])
    g = tl.arange(0, D // 16)
    tl.store(scale_ptr + orow[:, None] * (D // 16) + g[None, :], bcode.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _dequant_kernel(slot_ptr, data_ptr, scale_ptr, out_ptr, out32_ptr, gs, n_rows,
                    H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, OUT_PAIRED: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    t = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + t, mask=rmask, other=0).to(tl.int64)
    irow = slot * H + h
    d = tl.arange(0, D)
    out_ty = out_ptr.dtype.element_ty
    optr = out_ptr + r.to(tl.int64)[:, None] * D + d[None, :]
    if KIND == 0:
        v = tl.load(data_ptr + irow[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
        tl.store(optr, v.to(tl.float32).to(out_ty), mask=rmask[:, None])
    elif KIND == 3:
        db = tl.arange(0, D // 2)
        byte = tl.load(data_ptr + irow[:, None] * (D // 2) + db[None, :], mask=rmask[:, None], other=0).to(tl.int32)
        g = tl.arange(0, D // 16)
        sc = tl.load(scale_ptr + irow[:, None] * (D // 16) + g[None, :], mask=rmask[:, None], other=0)
        eff = (_e4m3_value(sc) * gs)[:, :, None]
        ve = tl.reshape(tl.reshape(_e2m1_value(byte & 0xF), (BLOCK_R, D // 16, 8)) * eff, (BLOCK_R, D // 2))
        vo = tl.reshape(tl.reshape(_e2m1_value(byte >> 4), (BLOCK_R, D // 16, 8)) * eff, (BLOCK_R, D // 2))
        if OUT_PAIRED:  # 16-bit output: write each even/odd pair as one 32-bit word
            lo = ve.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi = vo.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) << 16
            tl.store(out32_ptr + r.to(tl.int64)[:, None] * (D // 2) + db[None, :], lo | hi, mask=rmask[:, None])
        else:
            v = tl.reshape(tl.join(ve, vo), (BLOCK_R, D))
            tl.store(optr, v.to(out_ty), mask=rmask[:, None])
    else:
        NG: tl.constexpr = D // GROUP
        c = tl.load(data_ptr + irow[:, None] * D + d[None, :], mask=rmask[:, None], other=0)
        if KIND == 1:
            qv = c.to(tl.float32)
        else:
            qv = _e4m3_value(c)
        if NG == 1:
            s = tl.load(scale_ptr + irow, mask=rmask, other=0.0).to(tl.float32)
            v = qv * s[:, None]
        else:
            g = tl.arange(0, NG)
            s = tl.load(scale_ptr + irow[:, None] * NG + g[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(tl.reshape(qv, (BLOCK_R, NG, GROUP)) * s[:, :, None], (BLOCK_R, D))
        tl.store(optr, v.to(out_ty), mask=rmask[:, None])


def supports(fmt: SideFormat, head_dim: int) -> bool:
    """Whether the kernels handle this format and head_dim (block shapes must be powers of two)."""
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0
    if not pow2(head_dim) or head_dim < 16:
        return False
    return fmt.kind in ("bf16", "nvfp4") or (pow2(fmt.group) and head_dim % fmt.group == 0)


#: Launch shape: values per program and warps. 2048 x 4 was best or near best for 8 of the 10
#: write/gather cases in benchmarks/kv_profiles.py --sweep on an H200 (see docs/kv-profiles.md).
CONFIG = {"block_values": 2048, "num_warps": 4}


def _block_rows(head_dim: int) -> int:
    return max(1, CONFIG["block_values"] // head_dim)


def _typed_planes(fmt: SideFormat, planes):
    data = planes[0]
    if fmt.kind == "bf16":
        return data.view(torch.bfloat16), None
    if fmt.kind == "int8":
        return data.view(torch.int8), planes[1].view(torch.float16)
    if fmt.kind == "fp8":
        return data, planes[1].view(torch.float16)
    return data, planes[1]


def quantize_into(fmt: SideFormat, x: torch.Tensor, slots: torch.Tensor, planes, global_scale: float,
                  counter: torch.Tensor | None) -> None:
    """Quantise ``x`` ``[N, H, D]`` and store token i's rows at slot ``slots[i]`` of ``planes``
    (each ``uint8 [..., H, plane_bytes]``, contiguous); add the non-finite count to ``counter``
    (an int32 element) when given."""
    n, h, d = x.shape
    n_rows = n * h
    if n_rows == 0:
        return
    data, scale = _typed_planes(fmt, planes)
    br = _block_rows(d)
    grid = (triton.cdiv(n_rows, br),)
    cnt = counter if counter is not None else slots
    if fmt.kind == "nvfp4":
        paired = (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(0) % 2 == 0
                  and x.stride(1) % 2 == 0 and x.data_ptr() % 4 == 0)
        xs = x.view(torch.int32) if paired else x
        _quant_nvfp4_kernel[grid](xs, xs.stride(0), xs.stride(1), xs.stride(2), slots, data, scale, cnt,
                                  float(global_scale), n_rows, H=h, D=d, BLOCK_R=br,
                                  COUNT=counter is not None, PAIRED=paired, num_warps=CONFIG["num_warps"])
        return
    _quant_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), slots, data,
                        scale if scale is not None else data, cnt, n_rows, H=h, D=d, KIND=KIND_IDS[fmt.kind],
                        GROUP=max(fmt.group, 1), BLOCK_R=br, COUNT=counter is not None,
                        num_warps=CONFIG["num_warps"])


def dequantize_slots(fmt: SideFormat, planes, slots: torch.Tensor, head_dim: int, dtype: torch.dtype,
                     global_scale: float) -> torch.Tensor:
    """Rows at ``slots`` of ``planes`` dequantised to ``[len(slots), H, head_dim]`` in ``dtype``."""
    h = planes[0].shape[-2]
    n = slots.shape[0]
    out = torch.empty(n, h, head_dim, dtype=dtype, device=planes[0].device)
    n_rows = n * h
    if n_rows == 0:
        return out
    data, scale = _typed_planes(fmt, planes)
    br = _block_rows(head_dim)
    paired = fmt.kind == "nvfp4" and out.element_size() == 2
    out32 = out.view(torch.int32) if paired else out
    _dequant_kernel[(triton.cdiv(n_rows, br),)](slots, data, scale if scale is not None else data, out, out32,
                                               float(global_scale), n_rows, H=h, D=head_dim,
                                               KIND=KIND_IDS[fmt.kind], GROUP=max(fmt.group, 1),
                                               BLOCK_R=br, OUT_PAIRED=paired, num_warps=CONFIG["num_warps"])
    return out
