"""Torch reference of the built-in KV formats (spec §3.1): the numeric definition.

Every built-in KV profile stores each side (K or V) of one token and KV head in one of four
*side formats*:

``bf16``   the values as bfloat16 (one plane).
``int8``   int8 codes + one little-endian fp16 scale per ``group`` values (two planes):
           ``s = fp16(amax / 127)``, ``q = clamp(round_half_even(x / s), -127, 127)`` with the
           division by the *stored* (fp16-rounded) scale.
``fp8``    E4M3FN codes + one fp16 scale per ``group`` values: ``s = fp16(amax / 448)``,
           ``c = e4m3fn(clamp(x / s, -448, 448))`` rounded to nearest even (saturating).
``nvfp4``  E2M1 nibbles, two per byte (low nibble = even element) + one UE4M3 block scale per
           16 values, over a per-layer fp32 global scale ``g``:
           ``S = ue4m3(min(amax / (6 g), 448))``, ``c = e2m1(clamp(x / (S g), -6, 6))``,
           both rounded to nearest even; the value is ``e2m1(c) * (S g)``.

Policies shared by every format (docs/kv-profiles.md):

* Non-finite input never becomes a NaN block: before quantising, NaN -> 0 and +-inf -> +-FLT_MAX
  (bf16: +-BF16_MAX) (``sanitize``), the pool counts how many values were replaced, and every scale saturates at
  its format's largest finite value, so a stored block always decodes to finite numbers.
* A group whose stored scale is 0 (all zeros, or amax so small that the scale rounds to 0)
  stores all-zero codes and decodes to zeros.
* Zero is canonical: -0.0 is stored as the +0 code (only bf16 keeps the sign of a zero).
* Scales are little-endian (asserted: every machine we run on is).

The Triton kernels in ``kv_quant_triton`` compute the same codes with integer/fp32 arithmetic;
``e4m3_round_arith`` below is that arithmetic written in torch, tested equal to torch's own
float8 conversion.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

assert sys.byteorder == "little", "KV scale planes are little-endian; big-endian hosts are not supported"

FP16_MAX = 65504.0
E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
FLT_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max  # +-inf -> this in the bf16 format (FLT_MAX rounds to inf)
#: E2M1 magnitudes by 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True, slots=True)
class SideFormat:
    """How one side (K or V) of a record is stored: ``kind`` and values per scale."""

    kind: str  # "bf16" | "int8" | "fp8" | "nvfp4"
    group: int = 0  # values per scale; 0 for bf16, 16 for nvfp4

    def plane_bytes(self, head_dim: int) -> tuple[int, ...]:
        """Bytes per token and head of each plane of this side: (data,) or (data, scale)."""
        if self.kind == "bf16":
            return (2 * head_dim,)
        assert head_dim % self.group == 0, f"head_dim {head_dim} is not a multiple of group {self.group}"
        groups = head_dim // self.group
        if self.kind in ("int8", "fp8"):
            return (head_dim, 2 * groups)
        if self.kind == "nvfp4":
            assert self.group == 16, "nvfp4 uses 16-value blocks"
            return (head_dim // 2, groups)
        raise ValueError(f"unknown side format {self.kind!r}")

    @property
    def uses_global_scale(self) -> bool:
        return self.kind == "nvfp4"


# -- shared helpers --------------------------------------------------------------------------

def sanitize(x: torch.Tensor, limit: float = FLT_MAX) -> torch.Tensor:
    """``x`` as float32 with NaN -> 0 and +-inf -> +-``limit`` (the non-finite policy)."""
    x = x.to(torch.float32)
    return torch.nan_to_num(x, nan=0.0, posinf=limit, neginf=-limit)


def count_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """How many values of ``x`` the sanitiser replaces (a 0-d int64 tensor, no host sync)."""
    return (~torch.isfinite(x)).sum()


def round_half_even(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v)  # torch.round rounds half to even


def _fp16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``fp16(amax / qmax)``, saturating at the fp16 maximum (so an inf never appears). The
    divisor is a tensor: torch on CUDA divides by a Python number as a multiplication by its
    reciprocal, which is not the correctly rounded quotient."""
    return torch.clamp(amax / torch.full_like(amax, qmax), max=FP16_MAX).to(torch.float16)


def _safe_div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x / s`` where ``s > 0``, else 0 (the zero-group rule)."""
    return torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    n, h, d = x.shape
    return x.reshape(n, h, d // group, group)


def _as_bytes(t: torch.Tensor, n: int, h: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(n, h, -1)


# -- E4M3FN ----------------------------------------------------------------------------------

def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float32, |v| <= 448) rounded to nearest even E4M3FN, returned as its uint8 code.
    A zero (of either sign) gives the +0 code. Off the CPU this is ``e4m3_round_arith``: torch's
    CUDA float8 cast does not round every exact tie to even, so the reference would otherwise
    give other bytes there than on the CPU."""
    if v.device.type != "cpu":
        return e4m3_round_arith(v)
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_round_arith(v: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' integer/fp32 form of :func:`e4m3_round` (tested equal to it):
    take the quantum ``2^(max(e, -6) - 3)`` of ``|v|``'s binade, round ``|v|`` to a multiple of
    it (exact scaling by a power of two, then half-to-even), then assemble the bits."""
    a = v.abs().to(torch.float32)
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    qe = torch.clamp(e, min=-6) - 3  # quantum exponent, -9 .. 5
    inv_q = ((127 - qe) << 23).view(torch.float32)
    r = round_half_even(a * inv_q)  # 0 .. 16 quanta
    val = r * ((127 + qe) << 23).view(torch.float32)  # exact
    bits = val.view(torch.int32)
    normal = val >= 2.0 ** -6
    code = torch.where(normal, (((bits >> 23) & 0xFF) - 120) << 3 | ((bits >> 20) & 7),
                       (val * 512.0).to(torch.int32))
    code = torch.where((v < 0) & (code != 0), code | 0x80, code)
    return code.to(torch.uint8)


# -- E2M1 ------------------------------------------------------------------------------------

def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float32, |v| <= 6) rounded to nearest even E2M1, returned as its 4-bit code
    (uint8). The quantum is 0.5 below 2, 1 below 4 and 2 up to 6; a tie goes to the even code."""
    a = v.abs()
    q = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    r = round_half_even(a / q).to(torch.int32)  # exact: q is a power of two
    idx = torch.where(q == 0.5, r, torch.where(q == 1.0, r + 2, r + 4))
    idx = torch.where((v < 0) & (idx != 0), idx | 8, idx)
    return idx.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


# -- per format ------------------------------------------------------------------------------

def quantize_int8(x: torch.Tensor, group: int) -> list[torch.Tensor]:
    n, h, d = x.shape
    xg = _groups(sanitize(x), group)
    s = _fp16_scale(xg.abs().amax(-1, keepdim=True), INT8_MAX)
    q = torch.clamp(round_half_even(_safe_div(xg, s.to(torch.float32))), -INT8_MAX, INT8_MAX)
    return [_as_bytes(q.to(torch.int8), n, h), _as_bytes(s, n, h)]


def dequantize_int8(planes, group: int, dtype: torch.dtype) -> torch.Tensor:
    data, scale = planes
    n, h, d = data.shape
    q = data.contiguous().view(torch.int8).reshape(n, h, d // group, group).to(torch.float32)
    s = scale.contiguous().view(torch.float16).reshape(n, h, d // group, 1).to(torch.float32)
    return (q * s).reshape(n, h, d).to(dtype)


def quantize_fp8(x: torch.Tensor, group: int) -> list[torch.Tensor]:
    n, h, d = x.shape
    xg = _groups(sanitize(x), group)
    s = _fp16_scale(xg.abs().amax(-1, keepdim=True), E4M3_MAX)
    v = torch.clamp(_safe_div(xg, s.to(torch.float32)), -E4M3_MAX, E4M3_MAX)
    return [e4m3_round(v).reshape(n, h, d), _as_bytes(s, n, h)]


def dequantize_fp8(planes, group: int, dtype: torch.dtype) -> torch.Tensor:
    data, scale = planes
    n, h, d = data.shape
    v = e4m3_decode(data).reshape(n, h, d // group, group)
    s = scale.contiguous().view(torch.float16).reshape(n, h, d // group, 1).to(torch.float32)
    return (v * s).reshape(n, h, d).to(dtype)


def _gs(global_scale) -> torch.Tensor:
    gs = torch.as_tensor(1.0 if global_scale is None else global_scale, dtype=torch.float32)
    return gs.reshape(()).cpu()


def quantize_nvfp4(x: torch.Tensor, global_scale) -> list[torch.Tensor]:
    n, h, d = x.shape
    gs = _gs(global_scale).to(x.device)
    xg = _groups(sanitize(x), 16)
    amax = xg.abs().amax(-1, keepdim=True)
    block = e4m3_round(torch.clamp(amax / (gs * 6.0), max=E4M3_MAX))  # UE4M3: sign bit is 0
    eff = e4m3_decode(block) * gs  # the effective scale, fp32
    v = torch.clamp(_safe_div(xg, eff), -E2M1_MAX, E2M1_MAX)
    codes = e2m1_round(v).reshape(n, h, d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return [packed.contiguous(), block.reshape(n, h, d // 16).contiguous()]


def dequantize_nvfp4(planes, dtype: torch.dtype, global_scale) -> torch.Tensor:
    data, scale = planes
    n, h, b = data.shape
    gs = _gs(global_scale).to(data.device)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(n, h, b * 2 // 16, 16)
    eff = e4m3_decode(scale).reshape(n, h, b * 2 // 16, 1) * gs
    return (e2m1_decode(codes) * eff).reshape(n, h, 2 * b).to(dtype)


def quantize_bf16(x: torch.Tensor) -> list[torch.Tensor]:
    n, h, d = x.shape
    y = torch.clamp(sanitize(x, BF16_MAX), -BF16_MAX, BF16_MAX)  # finite fp32 beyond bf16 too
    return [_as_bytes(y.to(torch.bfloat16), n, h)]


def dequantize_bf16(planes, dtype: torch.dtype) -> torch.Tensor:
    (data,) = planes
    n, h, b = data.shape
    return data.contiguous().view(torch.bfloat16).reshape(n, h, b // 2).to(dtype)


# -- entry points ----------------------------------------------------------------------------

def quantize(fmt: SideFormat, x: torch.Tensor, global_scale=None) -> list[torch.Tensor]:
    """``x`` ``[N, H, D]`` -> this side's planes, each ``uint8 [N, H, plane_bytes]``."""
    assert x.dim() == 3, f"expected [N, H, D], got {tuple(x.shape)}"
    if fmt.kind == "bf16":
        return quantize_bf16(x)
    if fmt.kind == "int8":
        return quantize_int8(x, fmt.group)
    if fmt.kind == "fp8":
        return quantize_fp8(x, fmt.group)
    if fmt.kind == "nvfp4":
        return quantize_nvfp4(x, global_scale)
    raise ValueError(f"unknown side format {fmt.kind!r}")


def dequantize(fmt: SideFormat, planes, dtype: torch.dtype, global_scale=None) -> torch.Tensor:
    """This side's planes ``uint8 [N, H, plane_bytes]`` -> values ``[N, H, D]`` in ``dtype``."""
    if fmt.kind == "bf16":
        return dequantize_bf16(planes, dtype)
    if fmt.kind == "int8":
        return dequantize_int8(planes, fmt.group, dtype)
    if fmt.kind == "fp8":
        return dequantize_fp8(planes, fmt.group, dtype)
    if fmt.kind == "nvfp4":
        return dequantize_nvfp4(planes, dtype, global_scale)
    raise ValueError(f"unknown side format {fmt.kind!r}")
