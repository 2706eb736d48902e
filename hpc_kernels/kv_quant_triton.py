"""Triton twins of ``kv_quant_ref``: quantise new K/V straight into paged storage through a slot
mapping, and dequantise slots for attention.

Bit-exactness with the torch reference comes from doing the same IEEE operations, or operations
proven to give the same result: float -> fp16 and fp32 -> bf16 casts round to nearest even as
torch's do, and the E4M3/E2M1/int8 codes are assembled with integer arithmetic from values that
are exactly representable (see ``e4m3_round_arith`` and ``RINT_MAGIC``). The reference divides
every value by its scale and rounds the quotient, ``q = round_half_even(fl(x / s))``; the kernels
compute the same ``fl(x / s)`` in one of two ways:

* fast (``CONFIG["fast_div"] = True``, the default): one correctly rounded reciprocal per scale,
  ``inv = fl(1 / s)``, then per value a product and one or two remainder corrections
  (``_quotient``), which give ``fl(x / s)`` exactly (Markstein's theorem, and for scales with a
  short significand one correction; the argument is above ``_quotient``). Three fp32 operations
  per value (five for an NVFP4 global scale that is not a power of two) and no branch.
* exact (``CONFIG["fast_div"] = False``): a correctly rounded ``div_rn`` per value, the
  original kernels, kept as the baseline the benchmark times beside the fast path.

E4M3 codes and values come from the GPU's own conversion on sm_89 and newer (``HW_FP8``,
``CONFIG["hw_fp8"]``: ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even and saturates, as
the reference does; only -0 is mended to the canonical +0), else from integer arithmetic (always
under Triton's interpreter, whose fp8 casts do not round to nearest even).

Non-finite inputs show in the group maxima of ``|x|``, computed on the bit patterns (where a NaN
sorts above inf; NVFP4 uses NaN-propagating float maxima). A program whose block holds one (or, NVFP4, whose effective scale ``S * g``
lies outside the range the fast quotient is proven for) redoes the whole block by the exact path,
which counts and cleans non-finite values as the reference does; one reduction over the block's
group maxima decides, so finite data never pays for it.

Rows are (token, KV head) pairs; a program takes ``BLOCK_R`` rows of ``D`` values. A negative
slot skips its token (padding): its input is loaded (so the load need not wait for the slots)
but masked out of the group maxima, the exact path and the stores. The pool planes are ``uint8`` ``[slots, H, plane_bytes]``
contiguous; scale planes of fp16 scales are passed viewed as ``float16``.

Why one file of over 450 lines: it is one kernel family. The quantise, NVFP4 and dequantise
kernels share the ``@triton.jit`` helpers above them (the fast quotient and the proof it rests
on, the code grids, the group maxima), and the bit-exactness argument reads top to bottom beside
the code it covers; split, each kernel would import half of the others' helpers.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .kv_quant_ref import BF16_MAX, FLT_MAX, SideFormat

KIND_IDS = {"bf16": 0, "int8": 1, "fp8": 2, "nvfp4": 3}
BF16_LIM: tl.constexpr = tl.constexpr(BF16_MAX)
FLT_LIM: tl.constexpr = tl.constexpr(FLT_MAX)
#: NVFP4 effective scales S * g outside [EFF_MIN, EFF_MAX] take the exact path (fast division).
EFF_MIN: tl.constexpr = tl.constexpr(2.0 ** -100)
EFF_MAX: tl.constexpr = tl.constexpr(2.0 ** 100)
#: 1.5 * 2^23 and its bit pattern. For |v| <= 2^22, v + RINT_MAGIC lies in [2^23, 2^24), where
#: consecutive fp32 values are 1 apart, so the (round to nearest even) addition rounds v to an
#: integer n, half to even: (v + RINT_MAGIC) - RINT_MAGIC == n exactly, and the sum's bit pattern
#: is RINT_BITS + n. (Instead of libdevice.rint: an extern call, which Triton's interpreter
#: cannot run; two full-rate additions cost no more than one conversion. Neither the compiler
#: nor ptxas reassociates (v + c) - c without fast-math flags, which Triton does not set.)
RINT_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
RINT_BITS: tl.constexpr = tl.constexpr(0x4B400000)
#: RINT_BITS + 968, for the E4M3 code assembly in _e4m3_code.
E4M3_BIAS: tl.constexpr = tl.constexpr(0x4B400000 + 968)
#: Bit pattern of +inf: |x| bit patterns at or above it are inf or NaN.
INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)


# The fast quotient, and why it is fl(x / s) exactly.
#
# Let s > 0 be a scale (fp32), x a finite fp32 value, Q = x / s (real), u = 2^-24, and
# inv = fl(1 / s) (div_rn, once per scale). Then
#   y  = fl(x * inv)             = Q (1 + e),  |e| <= 2u + u^2
#   q1 = fma(fma(-y, s, x), inv, y)
#   q2 = fma(fma(-q1, s, x), inv, q1)
# The first remainder r0 = fl(x - y s) = s (Q - y)(1 + e0), so q1 = fl(y + (Q - y)(1 + e0)(1 + e1))
# is within half an ulp of Q plus |Q - y| * 2.0001u <= 4.1 u^2 |Q|, far less than another half
# ulp: q1 is a faithful rounding of Q (within one ulp). Markstein's theorem (Markstein 1990; Muller
# et al., Handbook of Floating-Point Arithmetic, the theorem on division with an fma): if inv
# is within half an ulp of 1 / s and q1 within one ulp of x / s, then x - q1 s is exactly
# representable (so the fma computes it exactly) and fl(q1 + (x - q1 s) inv) = fl(x / s). So q2
# is the reference's quotient, bit for bit, ties included, whenever nothing under- or overflows:
# * int8 / fp8: s is a positive fp16 scale, in [2^-24, 65504], so inv is a normal number; a
#   quotient that matters (|Q| >= 2^-10, the smallest midpoint of any code grid) has |x| >= 2^-34
#   and the remainders are multiples of 2^-72 or coarser; |x| <= BF16/FLT_MAX and y s ~ x stay
#   finite. A tiny |Q| may come out inexact, but it stays far below every midpoint (code 0).
# * nvfp4: s = S * g can be anything a global scale makes it; blocks with s outside
#   [2^-100, 2^100] take the exact path (``EFF_MIN``/``EFF_MAX``), which keeps every remainder
#   that matters a multiple of 2^-149 at worst and every product finite.
# * s = 0 (a zero group) passes inv = 0: y = 0, both corrections add 0 * r, q2 = 0, the
#   reference's ``_safe_div`` value.
#
# One correction is enough for a scale with a short significand. Write s = n 2^b with n odd and
# x = X 2^c with X an integer, |X| < 2^24, and let [2^E, 2^(E+1)) be |Q|'s binade, where the
# rounding boundaries of fp32 are the midpoints m = (2k + 1) 2^(E-24). |Q| >= 2^E gives
# 2^(c-b) >= n 2^E / |X| > 2^(E-24), so n Q = X 2^(c-b) and n m are both multiples of 2^(E-24):
# Q is either at least 2^(E-24) / n away from every midpoint, or equal to one; it never is (if n
# divides X 2^(c-b), Q has at most 24 significant bits and is an fp32 number; otherwise it is not
# a dyadic rational). q1 = fl(Q + d) with |d| <= 4.1 u^2 |Q| < 2^(E-44.9) (above), less than
# 2^(E-24) / n for n < 2^20, so no midpoint lies between Q and Q + d: q1 = fl(Q) already. An fp16
# scale has n < 2^11; an NVFP4 S * g with a power-of-two g has n <= 15 (S has 4 significant
# bits). So int8/fp8 always, and NVFP4 under a power-of-two global scale (the defaults and
# ``nvfp4_global_scale_for_amax``), stop at q1 (STEPS 1); other global scales take q2 (STEPS 2).
# A fused multiply-add that the compiler forms elsewhere (FP fusion) is harmless: every other
# product in these kernels is exact (a power-of-two scaling).


@triton.jit
def _quotient(x, s, inv, STEPS: tl.constexpr):
    """fl(x / s), exactly, from inv = fl(1 / s) (0 where s = 0), by STEPS (1 or 2) remainder
    corrections: 1 when s has fewer than 20 significant bits, else 2 (the proof above)."""
    y = x * inv
    y = tl.fma(tl.fma(-y, s, x), inv, y)  # faithful; fl(x / s) for a short s
    if STEPS == 2:
        y = tl.fma(tl.fma(-y, s, x), inv, y)  # correctly rounded (Markstein)
    return y


@triton.jit
def _int8_code(v):
    """|v| <= 127 (fp32) -> int32 code, rounded half to even."""
    return (v + RINT_MAGIC).to(tl.int32, bitcast=True) - RINT_BITS


@triton.jit
def _e4m3_code(v, HW: tl.constexpr = False):
    """|v| <= 448 (fp32) -> (uint8-valued int32 E4M3FN code, its fp32 value), nearest even.
    ex = max(biased exponent, 121): the binade's quantum is q = 2^(ex - 130) (subnormals share
    the lowest normal binade's 2^-9), t = |v| / q counts quanta exactly, n = rint(t); the code is
    8 (ex - 130) + 72 + n = 8 ex - 968 + n for normals and subnormals alike (n = 16 carries into
    the next binade): e4m3_round_arith's bit assembly in one sum. A zero gives the +0 code.
    HW: the GPU's conversion instead (cvt.rn.satfinite.e4m3x2.f32 on sm_89+: round to nearest
    even, saturating at 448; only -0 needs mending to the canonical +0)."""
    if HW:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        code = tl.where(code == 0x80, 0, code)
        return code, _e4m3_value(code, True)
    a = tl.abs(v)
    ex = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)
    q = ((ex - 3) << 23).to(tl.float32, bitcast=True)
    m = a * ((257 - ex) << 23).to(tl.float32, bitcast=True) + RINT_MAGIC
    code = (ex << 3) + m.to(tl.int32, bitcast=True) - E4M3_BIAS
    val = (m - RINT_MAGIC) * q  # exact
    code = tl.where((v < 0.0) & (code != 0), code | 0x80, code)
    return code, tl.where(v < 0.0, -val, val)


@triton.jit
def _e4m3_value(c, HW: tl.constexpr = False):
    """uint8/int32 E4M3FN code -> fp32 value (HW: the GPU's exact conversion)."""
    if HW:
        return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = c.to(tl.int32)
    ex = (c >> 3) & 0xF
    m = c & 7
    normal = (((ex + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_code(v):
    """v (fp32) clamped to [-6, 6] -> 4-bit E2M1 code as int32, nearest even. As in _e4m3_code:
    ex = max(biased exponent of |v|, 127), the quantum is 2^(ex - 128) (values below 1 share
    [1, 2)'s 0.5), t = |v| / quantum counts quanta exactly and the code is rint(t) + 2 (ex - 127)
    (0 .. 4 below 2, 4 .. 6 below 4, 6 .. 7 up to 6; a tie goes to the even code)."""
    a = tl.minimum(tl.abs(v), 6.0)
    ef = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 127 << 23)  # ex << 23
    m = a * ((255 << 23) - ef).to(tl.float32, bitcast=True) + RINT_MAGIC  # exact scaling, then rint
    code = m.to(tl.int32, bitcast=True) - (RINT_BITS + 254) + (ef >> 22)
    # the sign where the code is not 0 (|v| <= 0.25 rounds to 0, the tie to the even 0)
    return code | tl.where(v < -0.25, 8, 0)


@triton.jit
def e2m1_value(c):
    """E2M1 code (sign in bit 3) -> fp32 value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
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
def _abs_bits(x):
    """|x| (fp32) as int32 bit patterns: ordered as |x| for finite values; inf is INF_BITS and a
    NaN lies above it (a float max would skip the NaN)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block16_amax_bits(xe, xo, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Bit pattern of each 16-value block's max |x| from its even and odd halves: ``[BLOCK_R, NB]``
    (a NaN-propagating float maximum: a NaN or inf in the block gives bits >= INF_BITS)."""
    m = _max_nan(tl.abs(xe), tl.abs(xo))
    return tl.reduce(tl.reshape(m, (BLOCK_R, NB, 8)), 2, _max_nan).to(tl.int32, bitcast=True)


@triton.jit
def _group_amax_bits(x, BLOCK_R: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr):
    """Bit pattern of each group's max |x|: ``[BLOCK_R]`` for one group per row, else ``[BLOCK_R, NG]``."""
    b = _abs_bits(x)
    if NG == 1:
        amax = tl.max(b, axis=1)
    else:
        amax = tl.max(tl.reshape(b, (BLOCK_R, NG, GROUP)), axis=2)
    return amax


@triton.jit
def _by_group(t, BLOCK_R: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr):
    """Values ``[BLOCK_R, D]`` as ``[BLOCK_R, NG, GROUP]`` (unchanged for one group per row)."""
    if NG != 1:
        t = tl.reshape(t, (BLOCK_R, NG, GROUP))
    return t


@triton.jit
def _per_value(t, NG: tl.constexpr):
    """A per-group tensor broadcastable against ``_by_group`` values."""
    if NG == 1:
        t = t[:, None]
    else:
        t = t[:, :, None]
    return t


@triton.jit
def _per_row(t, NG: tl.constexpr):
    """A per-row tensor ``[BLOCK_R]`` broadcastable against per-group ones."""
    if NG != 1:
        t = t[:, None]
    return t


@triton.jit
def _fp16_scale(amax, KIND: tl.constexpr):
    """``fp16(min(amax / qmax, 65504))``: qmax 127 for int8 (KIND 1), 448 for fp8 (KIND 2)."""
    if KIND == 1:
        s = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
    else:
        s = tl.minimum(tl.math.div_rn(amax, 448.0), 65504.0).to(tl.float16)
    return s


@triton.jit
def _grid_codes(v, KIND: tl.constexpr, HW_FP8: tl.constexpr):
    """Quotients -> int32 codes: int8 (KIND 1) or E4M3FN (KIND 2), clamped first (the GPU's
    saturating conversion clamps by itself)."""
    if KIND == 1:
        code = _int8_code(tl.minimum(tl.maximum(v, -127.0), 127.0))
    elif HW_FP8:
        code, _ = _e4m3_code(v, True)
    else:
        code, _ = _e4m3_code(tl.minimum(tl.maximum(v, -448.0), 448.0))
    return code


@triton.jit
def _exact_grid_codes(x, cnt_ptr, BLOCK_R: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr,
                      KIND: tl.constexpr, COUNT: tl.constexpr, HW_FP8: tl.constexpr):
    """The exact-division path for int8/fp8: count and clean, a div_rn per value.
    Returns (codes by group, fp16 scales)."""
    x = _count_and_clean(x, cnt_ptr, FLT_LIM, COUNT)
    xv = _by_group(x, BLOCK_R, NG, GROUP)
    if NG == 1:
        amax = tl.max(tl.abs(xv), axis=1)
    else:
        amax = tl.max(tl.abs(xv), axis=2)
    s = _fp16_scale(amax, KIND)
    sf = _per_value(s.to(tl.float32), NG)
    pos = sf > 0.0
    return _grid_codes(tl.where(pos, tl.math.div_rn(xv, tl.where(pos, sf, 1.0)), 0.0), KIND, HW_FP8), s


@triton.jit
def _write_rows(pid, slot_ptr, n_rows, H: tl.constexpr, BLOCK_R: tl.constexpr):
    """A write program's rows (token, KV head): ``(token n, head h, in range, ok, row in the flat
    plane)``; a row past the end or with a negative slot (padding) is not ok. The input is loaded
    under ``in range`` alone, so its load does not wait for the slots' (two DRAM round trips in
    a row otherwise); rows that are not ok are masked out of the group maxima, the exact path and
    the stores."""
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    n = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + n, mask=rmask, other=-1).to(tl.int64)
    return n, h, rmask, rmask & (slot >= 0), slot * H + h


@triton.jit
def _nvfp4_halves(data_ptr, scale_ptr, rows, mask, gs, D: tl.constexpr, BLOCK: tl.constexpr,
                  HW_FP8: tl.constexpr = False):
    """NVFP4 rows ``rows`` dequantised as fp32 even and odd halves ``[BLOCK, D // 2]``."""
    db = tl.arange(0, D // 2)
    byte = tl.load(data_ptr + rows[:, None] * (D // 2) + db[None, :], mask=mask[:, None], other=0).to(tl.int32)
    g = tl.arange(0, D // 16)
    sc = tl.load(scale_ptr + rows[:, None] * (D // 16) + g[None, :], mask=mask[:, None], other=0)
    eff = (_e4m3_value(sc, HW_FP8) * gs)[:, :, None]
    ve = tl.reshape(tl.reshape(e2m1_value(byte & 0xF), (BLOCK, D // 16, 8)) * eff, (BLOCK, D // 2))
    vo = tl.reshape(tl.reshape(e2m1_value(byte >> 4), (BLOCK, D // 16, 8)) * eff, (BLOCK, D // 2))
    return ve, vo


@triton.jit
def dequant_tile(data_ptr, scale_ptr, rows, mask, gs, D: tl.constexpr, KIND: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr, HW_FP8: tl.constexpr = False):
    """Rows ``rows`` (flat ``slot * H + head``) of one side's planes dequantised to fp32
    ``[BLOCK, D]`` (masked rows read as 0): the gather kernel's and paged attention's reader."""
    d = tl.arange(0, D)
    if KIND == 0:
        v = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    elif KIND == 3:
        ve, vo = _nvfp4_halves(data_ptr, scale_ptr, rows, mask, gs, D, BLOCK, HW_FP8)
        v = tl.reshape(tl.join(ve, vo), (BLOCK, D))
    else:
        NG: tl.constexpr = D // GROUP
        c = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=mask[:, None], other=0)
        if KIND == 1:
            qv = c.to(tl.float32)
        else:
            qv = _e4m3_value(c, HW_FP8)
        if NG == 1:
            s = tl.load(scale_ptr + rows, mask=mask, other=0.0).to(tl.float32)
            v = qv * s[:, None]
        else:
            g = tl.arange(0, NG)
            s = tl.load(scale_ptr + rows[:, None] * NG + g[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(tl.reshape(qv, (BLOCK, NG, GROUP)) * s[:, :, None], (BLOCK, D))
    return v


@triton.jit
def _quant_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, n_rows,
                  H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_R: tl.constexpr, COUNT: tl.constexpr, FAST: tl.constexpr, HW_FP8: tl.constexpr):
    """bf16 (KIND 0), int8 (1) and fp8 (2) with one fp16 scale per GROUP values. FAST: the
    reciprocal quotient, the block redone by the exact path if it holds a non-finite value.
    HW_FP8: E4M3 codes by the GPU's conversion (sm_89+)."""
    pid = tl.program_id(0)
    n, h, rmask, ok, orow = _write_rows(pid, slot_ptr, n_rows, H, BLOCK_R)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + d[None, :] * sxd,
                mask=rmask[:, None], other=0.0).to(tl.float32)
    if KIND == 0:
        if FAST:
            # rare: a NaN or inf in a row that is stored
            if tl.max(tl.where(ok, tl.max(_abs_bits(x), axis=1), 0)) >= INF_BITS:
                x = _count_and_clean(tl.where(ok[:, None], x, 0.0), cnt_ptr, BF16_LIM, COUNT)
            x = tl.minimum(tl.maximum(x, -BF16_LIM), BF16_LIM)  # finite fp32 beyond bf16's range
        else:
            x = _count_and_clean(tl.where(ok[:, None], x, 0.0), cnt_ptr, BF16_LIM, COUNT)
        tl.store(data_ptr + orow[:, None] * D + d[None, :], x.to(tl.bfloat16), mask=ok[:, None])
    else:
        NG: tl.constexpr = D // GROUP
        if FAST:
            # Speculatively on the raw values: the group max of |x| through the bit patterns (a
            # NaN or inf shows as >= INF_BITS), one correctly rounded reciprocal per group (a
            # positive fp16 scale lies in [2^-24, 65504], so inv is a normal number), the exact
            # quotient per value (_quotient). A block with a non-finite value is redone.
            amax_bits = tl.where(_per_row(ok, NG), _group_amax_bits(x, BLOCK_R, NG, GROUP), 0)
            s = _fp16_scale(amax_bits.to(tl.float32, bitcast=True), KIND)
            sg = s.to(tl.float32)
            inv = _per_value(tl.where(sg > 0.0, tl.math.div_rn(1.0, tl.where(sg > 0.0, sg, 1.0)), 0.0), NG)
            code = _grid_codes(_quotient(_by_group(x, BLOCK_R, NG, GROUP), _per_value(sg, NG), inv, 1), KIND,
                               HW_FP8)
            if tl.max(amax_bits) >= INF_BITS:
                code, s = _exact_grid_codes(tl.where(ok[:, None], x, 0.0), cnt_ptr, BLOCK_R, NG, GROUP, KIND,
                                            COUNT, HW_FP8)
        else:
            code, s = _exact_grid_codes(tl.where(ok[:, None], x, 0.0), cnt_ptr, BLOCK_R, NG, GROUP, KIND,
                                        COUNT, HW_FP8)
        if KIND == 1:
            q = code.to(tl.int8)
        else:
            q = code.to(tl.uint8)
        if NG != 1:
            q = tl.reshape(q, (BLOCK_R, D))
        tl.store(data_ptr + orow[:, None] * D + d[None, :], q, mask=ok[:, None])
        if NG == 1:
            tl.store(scale_ptr + orow, s, mask=ok)
        else:
            g = tl.arange(0, NG)
            tl.store(scale_ptr + orow[:, None] * NG + g[None, :], s, mask=ok[:, None])


@triton.jit
def _nvfp4_block_scale(amax, gs, HW_FP8: tl.constexpr):
    """Block max |x| -> (UE4M3 block scale code, effective scale S * g), both ``[..., NB]``."""
    bcode, bval = _e4m3_code(tl.minimum(tl.math.div_rn(amax, gs * 6.0), 448.0), HW_FP8)
    return bcode, bval * gs


@triton.jit
def _nvfp4_codes(xe, xo, eff, inv, BLOCK_R: tl.constexpr, NB: tl.constexpr, FAST: tl.constexpr,
                 STEPS: tl.constexpr = 2):
    """Even and odd halves ``[BLOCK_R, D // 2]`` -> (even, odd) E2M1 codes ``[BLOCK_R, NB, 8]``
    over the effective block scales ``eff`` ``[BLOCK_R, NB]`` (inv = fl(1 / eff) and STEPS as
    in _quotient, FAST only)."""
    pos = (eff > 0.0)[:, :, None]
    e = eff[:, :, None]
    ge = tl.reshape(xe, (BLOCK_R, NB, 8))
    go = tl.reshape(xo, (BLOCK_R, NB, 8))
    if FAST:
        i = inv[:, :, None]
        qe = _quotient(ge, e, i, STEPS)
        qo = _quotient(go, e, i, STEPS)
    else:
        safe = tl.where(pos, e, 1.0)
        qe = tl.where(pos, tl.math.div_rn(ge, safe), 0.0)
        qo = tl.where(pos, tl.math.div_rn(go, safe), 0.0)
    ce = _e2m1_code(qe)
    co = _e2m1_code(qo)
    return ce, co


@triton.jit
def _exact_nvfp4_codes(xe, xo, cnt_ptr, gs, BLOCK_R: tl.constexpr, NB: tl.constexpr, COUNT: tl.constexpr,
                       HW_FP8: tl.constexpr):
    """The exact-division path for NVFP4: count and clean, a div_rn per value.
    Returns (even codes, odd codes, block scale codes)."""
    xe = _count_and_clean(xe, cnt_ptr, FLT_LIM, COUNT)
    xo = _count_and_clean(xo, cnt_ptr, FLT_LIM, COUNT)
    amax = tl.maximum(tl.max(tl.reshape(tl.abs(xe), (BLOCK_R, NB, 8)), axis=2),
                      tl.max(tl.reshape(tl.abs(xo), (BLOCK_R, NB, 8)), axis=2))
    bcode, eff = _nvfp4_block_scale(amax, gs, HW_FP8)
    ce, co = _nvfp4_codes(xe, xo, eff, eff, BLOCK_R, NB, False)
    return ce, co, bcode


@triton.jit
def _quant_nvfp4_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, gs, n_rows,
                        H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, COUNT: tl.constexpr,
                        PAIRED: tl.constexpr, FAST: tl.constexpr, HW_FP8: tl.constexpr, STEPS: tl.constexpr):
    """NVFP4-G16. PAIRED: ``x_ptr`` is bf16 input viewed as int32 (one even/odd pair per word,
    strides in words), so the pairs split with two shifts instead of a register shuffle."""
    gs = tl.full((), gs, tl.float32)  # fp32 when compiled; Triton 3.6's interpreter passes a Python float
    pid = tl.program_id(0)
    n, h, rmask, ok, orow = _write_rows(pid, slot_ptr, n_rows, H, BLOCK_R)
    i = tl.arange(0, D // 2)
    if PAIRED:
        w = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + i[None, :], mask=rmask[:, None], other=0)
        xe = (w << 16).to(tl.float32, bitcast=True)
        xo = (w & -65536).to(tl.float32, bitcast=True)
    else:
        base = x_ptr + n[:, None] * sxn + h[:, None] * sxh + (2 * i)[None, :] * sxd
        xe = tl.load(base, mask=rmask[:, None], other=0.0).to(tl.float32)
        xo = tl.load(base + sxd, mask=rmask[:, None], other=0.0).to(tl.float32)
    NB: tl.constexpr = D // 16
    if FAST:
        # As in _quant_kernel. eff = S * g is whatever the global scale makes it: a block with
        # eff outside [2^-100, 2^100] (or a non-finite value) redoes the block by the exact path.
        amax_bits = tl.where(ok[:, None], _block16_amax_bits(xe, xo, BLOCK_R, NB), 0)
        bcode, eff = _nvfp4_block_scale(amax_bits.to(tl.float32, bitcast=True), gs, HW_FP8)
        pos = eff > 0.0
        inv = tl.where(pos, tl.math.div_rn(1.0, tl.where(pos, eff, 1.0)), 0.0)
        ce, co = _nvfp4_codes(xe, xo, eff, inv, BLOCK_R, NB, True, STEPS)
        odd = (pos & ((eff < EFF_MIN) | (eff > EFF_MAX))) | (amax_bits >= INF_BITS)
        if tl.max(odd.to(tl.int32)) > 0:
            ce, co, bcode = _exact_nvfp4_codes(tl.where(ok[:, None], xe, 0.0), tl.where(ok[:, None], xo, 0.0),
                                               cnt_ptr, gs, BLOCK_R, NB, COUNT, HW_FP8)
    else:
        ce, co, bcode = _exact_nvfp4_codes(tl.where(ok[:, None], xe, 0.0), tl.where(ok[:, None], xo, 0.0),
                                           cnt_ptr, gs, BLOCK_R, NB, COUNT, HW_FP8)
    byte = tl.reshape(ce | (co << 4), (BLOCK_R, D // 2)).to(tl.uint8)
    tl.store(data_ptr + orow[:, None] * (D // 2) + i[None, :], byte, mask=ok[:, None])
    g = tl.arange(0, NB)
    tl.store(scale_ptr + orow[:, None] * NB + g[None, :], bcode.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _dequant_kernel(slot_ptr, data_ptr, scale_ptr, out_ptr, out32_ptr, gs, n_rows,
                    H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, OUT_PAIRED: tl.constexpr, HW_FP8: tl.constexpr, PAGE: tl.constexpr):
    """Rows of ``slot_ptr``'s slots (PAGE 0) or, PAGE > 0, of the pages ``slot_ptr`` lists in order
    (token t at slot ``page[t // PAGE] * PAGE + t % PAGE``: one page id serves PAGE tokens, so
    the table read before the data is mostly an L2 hit)."""
    gs = tl.full((), gs, tl.float32)  # as in _quant_nvfp4_kernel
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    t = (r // H).to(tl.int64)
    h = r % H
    if PAGE == 0:
        slot = tl.load(slot_ptr + t, mask=rmask, other=0).to(tl.int64)
    else:
        slot = tl.load(slot_ptr + t // PAGE, mask=rmask, other=0).to(tl.int64) * PAGE + t % PAGE
    irow = slot * H + h
    out_ty = out_ptr.dtype.element_ty
    if OUT_PAIRED:  # NVFP4 to a 16-bit dtype: write each even/odd pair as one 32-bit word
        ve, vo = _nvfp4_halves(data_ptr, scale_ptr, irow, rmask, gs, D, BLOCK_R, HW_FP8)
        lo = ve.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = vo.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) << 16
        db = tl.arange(0, D // 2)
        tl.store(out32_ptr + r.to(tl.int64)[:, None] * (D // 2) + db[None, :], lo | hi, mask=rmask[:, None])
    else:
        v = dequant_tile(data_ptr, scale_ptr, irow, rmask, gs, D, KIND, GROUP, BLOCK_R, HW_FP8)
        d = tl.arange(0, D)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :], v.to(out_ty), mask=rmask[:, None])


def supports(fmt: SideFormat, head_dim: int) -> bool:
    """Whether the kernels handle this format and head_dim (block shapes must be powers of two)."""
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0
    if not pow2(head_dim) or head_dim < 16:
        return False
    return fmt.kind in ("bf16", "nvfp4") or (pow2(fmt.group) and head_dim % fmt.group == 0)


#: Launch shape: values per program and warps (see docs/kv-profiles.md for the sweep).
#: fast_div: quantise with the reciprocal quotient (True) or with a div_rn per value (False);
#: both give the same bytes.
#: hw_fp8: E4M3 codes and values by the GPU's own conversion where it has one (sm_89+, not under
#: Triton's interpreter, whose fp8 casts do not round to nearest even): "auto" or False.
CONFIG = {"block_values": 4096, "num_warps": 4, "fast_div": True, "hw_fp8": "auto"}


def hw_fp8(device: torch.device) -> bool:
    """Whether the kernels convert E4M3 in hardware on ``device`` (CONFIG["hw_fp8"])."""
    if CONFIG["hw_fp8"] != "auto" or os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _power_of_two(g: float) -> bool:
    """Whether ``g`` is a positive power of two (an NVFP4 global scale whose products S * g keep
    S's 4 significant bits: one quotient correction suffices)."""
    return g > 0 and math.isfinite(g) and math.frexp(g)[0] == 0.5


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
    fast = bool(CONFIG["fast_div"])
    if fmt.kind == "nvfp4":
        paired = (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(0) % 2 == 0
                  and x.stride(1) % 2 == 0 and x.data_ptr() % 4 == 0)
        xs = x.view(torch.int32) if paired else x
        _quant_nvfp4_kernel[grid](xs, xs.stride(0), xs.stride(1), xs.stride(2), slots, data, scale, cnt,
                                  float(global_scale), n_rows, H=h, D=d, BLOCK_R=br,
                                  COUNT=counter is not None, PAIRED=paired, FAST=fast, HW_FP8=hw_fp8(x.device),
                                  STEPS=1 if _power_of_two(float(global_scale)) else 2,
                                  num_warps=CONFIG["num_warps"])
    else:
        _quant_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), slots, data,
                            scale if scale is not None else data, cnt, n_rows, H=h, D=d,
                            KIND=KIND_IDS[fmt.kind], GROUP=max(fmt.group, 1), BLOCK_R=br,
                            COUNT=counter is not None, FAST=fast, HW_FP8=hw_fp8(x.device),
                            num_warps=CONFIG["num_warps"])


def dequantize_slots(fmt: SideFormat, planes, slots: torch.Tensor, head_dim: int, dtype: torch.dtype,
                     global_scale: float, page_tokens: int = 0, n_tokens: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows at ``slots`` of ``planes`` dequantised to ``[len(slots), H, head_dim]`` in ``dtype``;
    with ``page_tokens`` > 0, ``slots`` are page ids instead and the first ``n_tokens`` tokens of
    those pages (in order) are read. ``out``: write there instead of a new tensor."""
    h = planes[0].shape[-2]
    n = slots.shape[0] if not page_tokens else n_tokens
    assert n is not None and (not page_tokens or n <= slots.shape[0] * page_tokens), \
        f"{n_tokens} tokens do not fit {slots.shape[0]} pages of {page_tokens}"
    if out is None:
        out = torch.empty(n, h, head_dim, dtype=dtype, device=planes[0].device)
    assert out.shape == (n, h, head_dim) and out.dtype == dtype and out.is_contiguous(), \
        f"out {tuple(out.shape)} {out.dtype} is not a contiguous [{n}, {h}, {head_dim}] {dtype} tensor"
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
                                               BLOCK_R=br, OUT_PAIRED=paired, HW_FP8=hw_fp8(out.device),
                                               PAGE=page_tokens, num_warps=CONFIG["num_warps"])
    return out
