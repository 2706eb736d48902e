"""Triton twins of ``kv_quant_ref``: quantise new K/V straight into paged storage through a slot
mapping, and dequantise slots for attention.

Bit-exactness with the torch reference comes from doing the same IEEE operations, or operations
proven to give the same result: float -> fp16 and fp32 -> bf16 casts round to nearest even as
torch's do, and the E4M3/E2M1 codes are assembled with integer arithmetic from values that are
exactly representable (see ``e4m3_round_arith``). The reference divides every value by its scale
(``q = round_half_even(fl(x / s))``); two kernel paths reproduce that:

* exact division (``CONFIG["fast_div"] = False``, the original kernels): every value takes a
  correctly rounded ``div_rn`` (Triton's ``/`` is approximate), half-to-even is a ``floor`` and an
  exact fraction test, and every block counts its non-finite values.
* fast division (the default): one ``div_rn`` per group for ``inv = fl(1 / s)``, then
  ``y = fl(x * inv)`` per value, rounded half to even with two fp32 additions (RINT_MAGIC).
  ``y`` can differ from ``fl(x / s)`` by a few units in the last place, which changes the code
  only when ``y`` lies next to a rounding midpoint of the code grid (the bound and the window
  are proven in the comment above ``_settle``). Non-finite inputs show in the group maxima of
  ``|x|``, computed on the bit patterns (where a NaN sorts above inf). A program whose block has
  a value in the window, a non-finite value, or (NVFP4) a scale whose reciprocal is not a normal
  number redoes the whole block by the exact path, so the stored bytes and the non-finite count
  are those of the exact path; one block-wide reduction decides.

Where that redo runs is ``CONFIG["redo"]``: ``"inline"`` (the default) compiles the exact path
into the fast kernel behind a dynamic branch; ``"second_launch"`` compiles the fast kernel
without it (it only writes one flag per program, 1 if its block needs the exact path) and runs
the exact path in a second kernel over the same grid, which returns at once for unflagged
programs and otherwise recomputes and overwrites the whole block (counting its non-finite
values, as the inline redo does). Both give the same bytes and counts; the second form exists to
measure whether the inline exact path costs the fast path registers (occupancy) or the barrier of
the block-wide reduction before the stores.

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
#: NVFP4 effective scales S * g outside [EFF_MIN, EFF_MAX] take the exact path (fast division).
EFF_MIN: tl.constexpr = tl.constexpr(2.0 ** -100)
EFF_MAX: tl.constexpr = tl.constexpr(2.0 ** 100)
#: 1.5 * 2^23 and its bit pattern. For |v| <= 2^22, v + RINT_MAGIC lies in [2^23, 2^24), where
#: consecutive fp32 values are 1 apart, so the (round to nearest even) addition rounds v to an
#: integer n, half to even: (v + RINT_MAGIC) - RINT_MAGIC == n exactly, and the sum's bit pattern
#: is RINT_BITS + n.
RINT_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
RINT_BITS: tl.constexpr = tl.constexpr(0x4B400000)
#: RINT_BITS + 968, for the E4M3 code assembly in _e4m3_code.
E4M3_BIAS: tl.constexpr = tl.constexpr(0x4B400000 + 968)
#: The fast-division window, in grid units per grid unit of the value (see the proof below).
WINDOW: tl.constexpr = tl.constexpr(2.0 ** -21)
#: Bit pattern of +inf: |x| bit patterns at or above it are inf or NaN.
INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)


@triton.jit
def _rne(v):
    """Round half to even, exactly (``floor(v + 0.5)`` would be wrong for v just below 0.5).
    The exact-division path's rounding; the fast path rounds with RINT_MAGIC."""
    r = tl.floor(v)
    frac = v - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


# Rounding by RINT_MAGIC instead of libdevice.rint (cvt.rni): libdevice functions are extern
# calls, which Triton's interpreter cannot run, and two full-rate fp32 additions cost no more than
# one conversion instruction. Neither the compiler nor ptxas reassociates (v + c) - c without
# fast-math flags, which Triton does not set. y = x * inv below feeds only the clamp (min/max),
# so no fused multiply-add can change it; a * (1 / quantum) is exact, so fusing it is harmless.
#
# Fast division, and why it is exact.
#
# Let s > 0 be a group's scale (fp32), x a finite fp32 value, v = x / s (real), r = fl(v) the
# reference's quotient, inv = fl(1 / s) a normal number, y = fl(x * inv), u = 2^-24. Then
#   inv = (1/s)(1 + e1),  y = x inv (1 + e2),  r = v (1 + e3),  |e1|, |e2|, |e3| <= u,
# so |y - r| <= (3u + u^2) |v| and, as |v| <= |y| / (1 - 2u - u^2),  |y - r| < 3.0001 u |y|.
# (If x * inv underflows, y and r are below 2^-125, far under the smallest rounding midpoint,
# 2^-10 for E4M3 subnormals, and both give code 0; if it overflows, both are far above the
# clamp.) The reference clamps to [-M, M] before rounding, M a grid value (127, 448, 6); so do
# the kernels. If |y| >= M, y clamps to M and r >= M (1 - 3.0001 u) rounds to M too (the nearest
# midpoint is M - quantum/2, much further down). Otherwise rounding to the code grid is constant
# between the midpoints of consecutive grid values, so the codes of y and r can differ only if a
# midpoint m lies between them or on one of them (a tie): |y - m| < 3.0001 u |y|. Binade edges
# (and E2M1's 2 and 4) are grid values and a neighbouring binade's midpoints are at least a
# quarter quantum away, so m is a midpoint of y's own binade. In grid units, t = |y| / quantum
# (exact: the quantum is a power of two; 0 <= t <= 127 for int8, <= 16 for E4M3, <= 4 for E2M1),
# the midpoints are k + 1/2, and a code can differ only if
#     1/2 - |t - rint(t)| < 3.0001 u t,   at most 2^-15.4 (int8), 2^-18.4 (E4M3), 2^-20.4 (E2M1).
# The kernels flag  1/2 - |t - rint(t)| <= 2^-21 t  (8 u t, 2.6 times the bound), evaluated
# exactly: t - rint(t) and 1/2 - d are exact (Sterbenz; d < 1/4 is far from the window anyway)
# and 2^-21 t is a power-of-two scaling. A flagged value is settled in one of two ways (_settle):
# * an exact tie of the reference: |x| = m_t q s exactly, m_t the midpoint next to t (then
#   |x| / s = m_t q is representable, r is that midpoint, and the reference rounds it half to
#   even; the kernel rounds m_t half to even). fma(m_t q, s, -|x|) rounds once, and the exact
#   difference is a multiple of 2^-149 (so are |x| and m_t q s: s >= 2^-24 for int8/fp8, and an
#   NVFP4 block needs S * g in [2^-100, 2^100], else it is redone), so it is 0 only for equality.
#   With bf16 input these ties are common (an 8-bit x over an 11-bit fp16 scale, or a 4-bit
#   S * g with a power-of-two g, often is a midpoint exactly), and they are then the only
#   flagged values: x - m_t q s is a multiple of a granule far coarser than the window.
# * anything else is "unsure": the program redoes its whole block by the exact path.
# Where it matters inv is a normal number: a positive fp16 scale lies in [2^-24, 65504]; NVFP4's
# S * g can be anything a global scale makes it, hence the range test. A value lands in the
# window with probability about 2^-20 t, so with fp32 input a few per cent of 2048-value int8
# programs (fewer for the others) redo their block; with bf16 input almost none.


@triton.jit
def _settle(t, n, q, xa, sf, TIES: tl.constexpr):
    """Fast path, in grid units: t >= 0 the value, n = rint(t), q the quantum (the quotient's
    magnitude is t * q), xa = |x|, sf = the scale. Returns (t', unsure): t' is t, or the midpoint
    next to t where |x| / s is exactly that midpoint (the reference sees a tie there, whatever
    t's last bits say; the test is exact: an fma rounds once, so it gives 0 only for equality);
    unsure marks the other values in the window (the proof above), whose block is redone."""
    d = t - n
    near = 0.5 - tl.abs(d) <= t * WINDOW
    if TIES:
        mt = n + tl.where(d > 0.0, 0.5, -0.5)
        tie = near & (tl.fma(mt * q, sf, -xa) == 0.0)
        t = tl.where(tie, mt, t)
        near = near & (~tie)
    return t, near


@triton.jit
def _int8_code(v, xa, sf, FAST: tl.constexpr):
    """|v| <= 127 (fp32) -> (int32 code, unsure), rounded half to even."""
    if FAST:
        t, unsure = _settle(tl.abs(v), tl.abs((v + RINT_MAGIC) - RINT_MAGIC), 1.0, xa, sf, True)
        code = (tl.where(v < 0.0, -t, t) + RINT_MAGIC).to(tl.int32, bitcast=True) - RINT_BITS
    else:
        code = _rne(v).to(tl.int32)
        unsure = v != v  # unused: the exact path has no window
    return code, unsure


@triton.jit
def _e4m3_code(v, xa, sf, FAST: tl.constexpr, TIES: tl.constexpr):
    """|v| <= 448 (fp32) -> (uint8-valued int32 E4M3FN code, its fp32 value, unsure), nearest
    even. TIES: v is a fast quotient (see _settle; xa, sf unused otherwise)."""
    a = tl.abs(v)
    if FAST:
        # ex = max(biased exponent, 121): the binade's quantum is q = 2^(ex - 130) (subnormals
        # share the lowest normal binade's 2^-9), t = a / q counts quanta exactly, n = rint(t).
        # The code is 8 (ex - 130) + 72 + n = 8 ex - 968 + n for normals and subnormals alike
        # (n = 16 carries into the next binade): e4m3_round_arith's bit assembly in one sum.
        ex = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)
        q = ((ex - 3) << 23).to(tl.float32, bitcast=True)
        t = a * ((257 - ex) << 23).to(tl.float32, bitcast=True)
        t, unsure = _settle(t, (t + RINT_MAGIC) - RINT_MAGIC, q, xa, sf, TIES)
        m = t + RINT_MAGIC
        code = (ex << 3) + m.to(tl.int32, bitcast=True) - E4M3_BIAS
        val = (m - RINT_MAGIC) * q  # exact
    else:
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        qe = tl.maximum(e, -6) - 3
        inv_q = ((127 - qe) << 23).to(tl.float32, bitcast=True)
        q = ((127 + qe) << 23).to(tl.float32, bitcast=True)
        val = _rne(a * inv_q) * q  # exact
        bits = val.to(tl.int32, bitcast=True)
        code = tl.where(val >= 0.015625, ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7),
                        (val * 512.0).to(tl.int32))
        unsure = v != v  # unused
    code = tl.where((v < 0.0) & (code != 0), code | 0x80, code)
    return code, tl.where(v < 0.0, -val, val), unsure


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
def _e2m1_code(v, xa, sf, FAST: tl.constexpr):
    """|v| <= 6 (fp32) -> (4-bit E2M1 code as int32, unsure), nearest even."""
    a = tl.abs(v)
    inv_q = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))  # 1 / quantum, exact
    t = a * inv_q  # quanta, 0 .. 4
    if FAST:
        q = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
        t, unsure = _settle(t, (t + RINT_MAGIC) - RINT_MAGIC, q, xa, sf, True)
        r = (t + RINT_MAGIC).to(tl.int32, bitcast=True) - RINT_BITS
    else:
        r = _rne(t).to(tl.int32)
        unsure = v != v  # unused
    idx = tl.where(inv_q == 2.0, r, tl.where(inv_q == 1.0, r + 2, r + 4))
    return tl.where((v < 0.0) & (idx != 0), idx | 8, idx), unsure


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
def _abs_bits(x):
    """|x| (fp32) as int32 bit patterns: ordered as |x| for finite values; inf is INF_BITS and a
    NaN lies above it (a float max would skip the NaN)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _block16_amax_bits(xe, xo, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Bit pattern of each 16-value block's max |x| from its even and odd halves: ``[BLOCK_R, NB]``."""
    be = tl.max(tl.reshape(_abs_bits(xe), (BLOCK_R, NB, 8)), axis=2)
    return tl.maximum(be, tl.max(tl.reshape(_abs_bits(xo), (BLOCK_R, NB, 8)), axis=2))


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
def _fp16_scale(amax, KIND: tl.constexpr):
    """``fp16(min(amax / qmax, 65504))``: qmax 127 for int8 (KIND 1), 448 for fp8 (KIND 2)."""
    if KIND == 1:
        s = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
    else:
        s = tl.minimum(tl.math.div_rn(amax, 448.0), 65504.0).to(tl.float16)
    return s


@triton.jit
def _grid_codes(v, xa, sf, KIND: tl.constexpr, FAST: tl.constexpr):
    """Quotients -> (int32 codes, unsure flags): int8 (KIND 1) or E4M3FN (KIND 2), clamped
    first. xa = |x|, sf = the scale (used by the fast path's tie test)."""
    if KIND == 1:
        code, unsure = _int8_code(tl.minimum(tl.maximum(v, -127.0), 127.0), xa, sf, FAST)
    else:
        code, _, unsure = _e4m3_code(tl.minimum(tl.maximum(v, -448.0), 448.0), xa, sf, FAST, FAST)
    return code, unsure


@triton.jit
def _exact_grid_codes(x, cnt_ptr, BLOCK_R: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr,
                      KIND: tl.constexpr, COUNT: tl.constexpr):
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
    code, _ = _grid_codes(tl.where(pos, tl.math.div_rn(xv, tl.where(pos, sf, 1.0)), 0.0), xv, sf, KIND, False)
    return code, s


@triton.jit
def _write_rows(pid, slot_ptr, n_rows, H: tl.constexpr, BLOCK_R: tl.constexpr):
    """A write program's rows (token, KV head): ``(token n, head h, ok, row in the flat plane)``;
    a row past the end or with a negative slot (padding) is not ok."""
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    n = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + n, mask=rmask, other=-1).to(tl.int64)
    return n, h, rmask & (slot >= 0), slot * H + h


@triton.jit
def _nvfp4_halves(data_ptr, scale_ptr, rows, mask, gs, D: tl.constexpr, BLOCK: tl.constexpr):
    """NVFP4 rows ``rows`` dequantised as fp32 even and odd halves ``[BLOCK, D // 2]``."""
    db = tl.arange(0, D // 2)
    byte = tl.load(data_ptr + rows[:, None] * (D // 2) + db[None, :], mask=mask[:, None], other=0).to(tl.int32)
    g = tl.arange(0, D // 16)
    sc = tl.load(scale_ptr + rows[:, None] * (D // 16) + g[None, :], mask=mask[:, None], other=0)
    eff = (_e4m3_value(sc) * gs)[:, :, None]
    ve = tl.reshape(tl.reshape(_e2m1_value(byte & 0xF), (BLOCK, D // 16, 8)) * eff, (BLOCK, D // 2))
    vo = tl.reshape(tl.reshape(_e2m1_value(byte >> 4), (BLOCK, D // 16, 8)) * eff, (BLOCK, D // 2))
    return ve, vo


@triton.jit
def dequant_tile(data_ptr, scale_ptr, rows, mask, gs, D: tl.constexpr, KIND: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``rows`` (flat ``slot * H + head``) of one side's planes dequantised to fp32
    ``[BLOCK, D]`` (masked rows read as 0): the gather kernel's and paged attention's reader."""
    d = tl.arange(0, D)
    if KIND == 0:
        v = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    elif KIND == 3:
        ve, vo = _nvfp4_halves(data_ptr, scale_ptr, rows, mask, gs, D, BLOCK)
        v = tl.reshape(tl.join(ve, vo), (BLOCK, D))
    else:
        NG: tl.constexpr = D // GROUP
        c = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=mask[:, None], other=0)
        if KIND == 1:
            qv = c.to(tl.float32)
        else:
            qv = _e4m3_value(c)
        if NG == 1:
            s = tl.load(scale_ptr + rows, mask=mask, other=0.0).to(tl.float32)
            v = qv * s[:, None]
        else:
            g = tl.arange(0, NG)
            s = tl.load(scale_ptr + rows[:, None] * NG + g[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(tl.reshape(qv, (BLOCK, NG, GROUP)) * s[:, :, None], (BLOCK, D))
    return v


@triton.jit
def _quant_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, flag_ptr, n_rows,
                  H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_R: tl.constexpr, COUNT: tl.constexpr, FAST: tl.constexpr, REDO: tl.constexpr):
    """bf16 (KIND 0), int8 (1) and fp8 (2) with one fp16 scale per GROUP values. FAST: the
    reciprocal division, redoing a block by the exact path when it needs it (module doc).
    REDO (int8/fp8 only): 0 redo inline; 1 (with FAST) no exact path compiled in, write
    ``flag_ptr[pid]`` = whether the block needs it; 2 (without FAST) the exact path for the
    programs flagged by a REDO 1 launch over the same grid, nothing for the others."""
    pid = tl.program_id(0)
    if REDO == 2:
        if tl.load(flag_ptr + pid) == 0:
            return
    n, h, ok, orow = _write_rows(pid, slot_ptr, n_rows, H, BLOCK_R)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + d[None, :] * sxd,
                mask=ok[:, None], other=0.0).to(tl.float32)
    if KIND == 0:
        if FAST:
            if tl.max(_abs_bits(x)) >= INF_BITS:  # rare: a NaN or inf in the block
                x = _count_and_clean(x, cnt_ptr, BF16_LIM, COUNT)
            x = tl.minimum(tl.maximum(x, -BF16_LIM), BF16_LIM)  # finite fp32 beyond bf16's range
        else:
            x = _count_and_clean(x, cnt_ptr, BF16_LIM, COUNT)
        tl.store(data_ptr + orow[:, None] * D + d[None, :], x.to(tl.bfloat16), mask=ok[:, None])
    else:
        NG: tl.constexpr = D // GROUP
        if FAST:
            # Speculatively on the raw values: the group max of |x| through the bit patterns (a
            # NaN or inf shows as >= INF_BITS), one correctly rounded reciprocal per group (a
            # positive fp16 scale lies in [2^-24, 65504], so inv is a normal number), one
            # multiplication per value. A block with a non-finite value or a value in the window
            # of a midpoint is redone by the exact path; one block-wide reduction decides.
            amax_bits = _group_amax_bits(x, BLOCK_R, NG, GROUP)
            s = _fp16_scale(amax_bits.to(tl.float32, bitcast=True), KIND)
            sf = _per_value(s.to(tl.float32), NG)
            pos = sf > 0.0
            inv = tl.where(pos, tl.math.div_rn(1.0, tl.where(pos, sf, 1.0)), 0.0)
            xv = _by_group(x, BLOCK_R, NG, GROUP)
            code, unsure = _grid_codes(xv * inv, tl.abs(xv), sf, KIND, True)
            redo = unsure | _per_value(amax_bits >= INF_BITS, NG)
            if REDO == 1:  # the second launch redoes the block
                tl.store(flag_ptr + pid, tl.max(redo.to(tl.int32)).to(tl.int8))
            elif tl.max(redo.to(tl.int32)) > 0:
                code, s = _exact_grid_codes(x, cnt_ptr, BLOCK_R, NG, GROUP, KIND, COUNT)
        else:
            code, s = _exact_grid_codes(x, cnt_ptr, BLOCK_R, NG, GROUP, KIND, COUNT)
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
def _nvfp4_block_scale(amax, gs, FAST: tl.constexpr):
    """Block max |x| -> (UE4M3 block scale code, effective scale S * g ``[..., 1]``)."""
    ratio = tl.minimum(tl.math.div_rn(amax, gs * 6.0), 448.0)
    bcode, bval, _ = _e4m3_code(ratio, ratio, ratio, FAST, False)
    return bcode, (bval * gs)[:, :, None]


@triton.jit
def _exact_nvfp4_codes(xe, xo, cnt_ptr, gs, BLOCK_R: tl.constexpr, NB: tl.constexpr, COUNT: tl.constexpr):
    """The exact-division path for NVFP4: count and clean, a div_rn per value.
    Returns (even codes, odd codes, block scale codes)."""
    xe = tl.reshape(_count_and_clean(xe, cnt_ptr, FLT_LIM, COUNT), (BLOCK_R, NB, 8))
    xo = tl.reshape(_count_and_clean(xo, cnt_ptr, FLT_LIM, COUNT), (BLOCK_R, NB, 8))
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))
    bcode, eff = _nvfp4_block_scale(amax, gs, False)
    pos = eff > 0.0
    safe = tl.where(pos, eff, 1.0)
    ce, _ = _e2m1_code(tl.minimum(tl.maximum(tl.where(pos, tl.math.div_rn(xe, safe), 0.0), -6.0), 6.0), xe, eff, False)
    co, _ = _e2m1_code(tl.minimum(tl.maximum(tl.where(pos, tl.math.div_rn(xo, safe), 0.0), -6.0), 6.0), xo, eff, False)
    return ce, co, bcode


@triton.jit
def _quant_nvfp4_kernel(x_ptr, sxn, sxh, sxd, slot_ptr, data_ptr, scale_ptr, cnt_ptr, flag_ptr, gs, n_rows,
                        H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, COUNT: tl.constexpr,
                        PAIRED: tl.constexpr, FAST: tl.constexpr, REDO: tl.constexpr):
    """NVFP4-G16. PAIRED: ``x_ptr`` is bf16 input viewed as int32 (one even/odd pair per word,
    strides in words), so the pairs split with two shifts instead of a register shuffle. REDO as
    in _quant_kernel."""
    gs = tl.full((), gs, tl.float32)  # fp32 when compiled; Triton 3.6's interpreter passes a Python float
    pid = tl.program_id(0)
    if REDO == 2:
        if tl.load(flag_ptr + pid) == 0:
            return
    n, h, ok, orow = _write_rows(pid, slot_ptr, n_rows, H, BLOCK_R)
    i = tl.arange(0, D // 2)
    if PAIRED:
        w = tl.load(x_ptr + n[:, None] * sxn + h[:, None] * sxh + i[None, :], mask=ok[:, None], other=0)
        xe = (w << 16).to(tl.float32, bitcast=True)
        xo = (w & -65536).to(tl.float32, bitcast=True)
    else:
        base = x_ptr + n[:, None] * sxn + h[:, None] * sxh + (2 * i)[None, :] * sxd
        xe = tl.load(base, mask=ok[:, None], other=0.0).to(tl.float32)
        xo = tl.load(base + sxd, mask=ok[:, None], other=0.0).to(tl.float32)
    NB: tl.constexpr = D // 16
    if FAST:
        # As in _quant_kernel. eff = S * g is whatever the global scale makes it: a block with
        # eff outside [2^-100, 2^100] is redone too (inv must be a normal number, and the tie
        # test exact; see the proof above _settle).
        amax_bits = _block16_amax_bits(xe, xo, BLOCK_R, NB)
        bcode, eff = _nvfp4_block_scale(amax_bits.to(tl.float32, bitcast=True), gs, True)
        pos = eff > 0.0
        inv = tl.where(pos, tl.math.div_rn(1.0, tl.where(pos, eff, 1.0)), 0.0)
        odd = (pos & ((eff < EFF_MIN) | (eff > EFF_MAX))) | (amax_bits >= INF_BITS)[:, :, None]
        ge = tl.reshape(xe, (BLOCK_R, NB, 8))
        go = tl.reshape(xo, (BLOCK_R, NB, 8))
        ce, ne = _e2m1_code(tl.minimum(tl.maximum(ge * inv, -6.0), 6.0), tl.abs(ge), eff, True)
        co, no = _e2m1_code(tl.minimum(tl.maximum(go * inv, -6.0), 6.0), tl.abs(go), eff, True)
        if REDO == 1:  # the second launch redoes the block
            tl.store(flag_ptr + pid, tl.max((ne | no | odd).to(tl.int32)).to(tl.int8))
        elif tl.max((ne | no | odd).to(tl.int32)) > 0:
            ce, co, bcode = _exact_nvfp4_codes(xe, xo, cnt_ptr, gs, BLOCK_R, NB, COUNT)
    else:
        ce, co, bcode = _exact_nvfp4_codes(xe, xo, cnt_ptr, gs, BLOCK_R, NB, COUNT)
    byte = tl.reshape(ce | (co << 4), (BLOCK_R, D // 2)).to(tl.uint8)
    tl.store(data_ptr + orow[:, None] * (D // 2) + i[None, :], byte, mask=ok[:, None])
    g = tl.arange(0, NB)
    tl.store(scale_ptr + orow[:, None] * NB + g[None, :], bcode.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _dequant_kernel(slot_ptr, data_ptr, scale_ptr, out_ptr, out32_ptr, gs, n_rows,
                    H: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, OUT_PAIRED: tl.constexpr):
    gs = tl.full((), gs, tl.float32)  # as in _quant_nvfp4_kernel
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    t = (r // H).to(tl.int64)
    h = r % H
    slot = tl.load(slot_ptr + t, mask=rmask, other=0).to(tl.int64)
    irow = slot * H + h
    out_ty = out_ptr.dtype.element_ty
    if KIND == 3 and OUT_PAIRED:  # 16-bit output: write each even/odd pair as one 32-bit word
        ve, vo = _nvfp4_halves(data_ptr, scale_ptr, irow, rmask, gs, D, BLOCK_R)
        lo = ve.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = vo.to(out_ty).to(tl.int16, bitcast=True).to(tl.int32) << 16
        db = tl.arange(0, D // 2)
        tl.store(out32_ptr + r.to(tl.int64)[:, None] * (D // 2) + db[None, :], lo | hi, mask=rmask[:, None])
    else:
        v = dequant_tile(data_ptr, scale_ptr, irow, rmask, gs, D, KIND, GROUP, BLOCK_R)
        d = tl.arange(0, D)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :], v.to(out_ty), mask=rmask[:, None])


def supports(fmt: SideFormat, head_dim: int) -> bool:
    """Whether the kernels handle this format and head_dim (block shapes must be powers of two)."""
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0
    if not pow2(head_dim) or head_dim < 16:
        return False
    return fmt.kind in ("bf16", "nvfp4") or (pow2(fmt.group) and head_dim % fmt.group == 0)


#: Launch shape: values per program and warps. 2048 x 4 was best or near best for 8 of the 10
#: write/gather cases in benchmarks/kv_profiles.py --sweep on an H200 (see docs/kv-profiles.md).
#: fast_div: quantise with the exact reciprocal division (True) or with a div_rn per value and
#: the original rounding and counting (False); both give the same bytes.
#: redo (fast division, int8/fp8/nvfp4): where a block that needs the exact path is redone:
#: "inline" (in the same kernel, behind a dynamic branch) or "second_launch" (the fast kernel
#: flags the block, a second kernel over the same grid redoes flagged blocks); the same bytes.
CONFIG = {"block_values": 2048, "num_warps": 4, "fast_div": True, "redo": "inline"}
REDO_MODES = ("inline", "second_launch")


def _redo_modes(kind: str) -> tuple[int, ...]:
    """The REDO constexprs of the launches for one write: (0,) or (1, 2) (module doc)."""
    mode = CONFIG["redo"]
    assert mode in REDO_MODES, f"CONFIG['redo'] = {mode!r}, expected one of {REDO_MODES}"
    if kind == "bf16" or not CONFIG["fast_div"] or mode == "inline":
        return (0,)
    return (1, 2)


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
    modes = _redo_modes(fmt.kind)
    # second_launch: one int8 flag per program, each written by the first launch (no memset, no
    # host read: capture-safe).
    flags = torch.empty(grid[0], dtype=torch.int8, device=x.device) if modes != (0,) else slots
    for redo in modes:
        fast = bool(CONFIG["fast_div"]) and redo != 2
        if fmt.kind == "nvfp4":
            paired = (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(0) % 2 == 0
                      and x.stride(1) % 2 == 0 and x.data_ptr() % 4 == 0)
            xs = x.view(torch.int32) if paired else x
            _quant_nvfp4_kernel[grid](xs, xs.stride(0), xs.stride(1), xs.stride(2), slots, data, scale, cnt,
                                      flags, float(global_scale), n_rows, H=h, D=d, BLOCK_R=br,
                                      COUNT=counter is not None, PAIRED=paired, FAST=fast, REDO=redo,
                                      num_warps=CONFIG["num_warps"])
        else:
            _quant_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), slots, data,
                                scale if scale is not None else data, cnt, flags, n_rows, H=h, D=d,
                                KIND=KIND_IDS[fmt.kind], GROUP=max(fmt.group, 1), BLOCK_R=br,
                                COUNT=counter is not None, FAST=fast, REDO=redo,
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
