"""Built-in KV profiles (spec §3.1): bf16, int8-g64, fp8-e4m3fn-row256, nvfp4-g16, k8v4.

Each profile says which *side format* (``hpc_kernels.kv_quant_ref.SideFormat``) stores its K and
its V; the numeric definition of every format lives in ``hpc_kernels/kv_quant_ref.py`` (the torch
reference) with its Triton twin in ``hpc_kernels/kv_quant_triton.py``. Byte layouts, rounding rules
and the zero/-0/NaN/inf policy: docs/kv-profiles.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import hpc_cli
from hpc_cli.kv_profile import PAGE_TOKENS, KVProfile, PlaneSpec, RecordLayout

SLAB_ALIGN = 4096  # host slab records are rounded up to 4 KiB (spec §5.4)
#: Data-plane bytes per value of each side format's kind.
_DATA_BYTES_PER_VALUE = {"bf16": 2.0, "int8": 1.0, "fp8": 1.0, "nvfp4": 0.5}


def _check_groups(name: str, head_dim: int, group: int) -> None:
    if head_dim % group:
        from hpc_cli.errors import ConfigError

        raise ConfigError(
            f"KV profile {name} needs a head_dim divisible by {group}, got {head_dim}",
            hint="choose kv.profile = 'bf16' for this model, or a profile whose groups divide head_dim",
        )


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What the pools need to know about one page of a profile (spec §5.4, §11.2).

    Device: per layer and plane a ``uint8`` tensor ``[pages, page_tokens, kv_heads, plane_bytes]``.
    Host: a slab record packs one page's planes back to back, layer by layer in plane order
    (``record_bytes``); a backend page, if any, starts at the next 4 KiB boundary and the slab is
    the whole rounded up to 4 KiB (``slab_bytes``).
    """

    layout: RecordLayout
    kv_heads: int
    layers: int
    page_tokens: int = PAGE_TOKENS

    @property
    def plane_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.layout.planes)

    @property
    def plane_page_bytes(self) -> tuple[int, ...]:
        """Bytes of one page of each plane in one layer."""
        return tuple(self.page_tokens * self.kv_heads * p.bytes_per_token_head for p in self.layout.planes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and plane (the packed host record)."""
        return sum(self.plane_page_bytes) * self.layers

    record_bytes = page_bytes

    def plane_offset(self, layer: int, plane: int) -> int:
        """Byte offset of (layer, plane) inside the packed host record."""
        return layer * sum(self.plane_page_bytes) + sum(self.plane_page_bytes[:plane])

    def slab_bytes(self, backend_page_bytes: int = 0) -> int:
        """The host slab for this page plus an optional backend page (spec §5.4)."""
        total = self.page_bytes
        if backend_page_bytes:
            total = _round_up(total, SLAB_ALIGN) + backend_page_bytes
        return _round_up(total, SLAB_ALIGN)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


class _BuiltinProfile(KVProfile):
    """A profile whose sides are built-in side formats; the reference math is in hpc_kernels."""

    #: The side format kind of K and of V (the groups may depend on head_dim: see side_format).
    side_kinds: dict[str, str] = {}

    def side_format(self, side: str, head_dim: int):
        """The ``SideFormat`` that stores ``side`` for this head_dim."""
        raise NotImplementedError

    def layout(self, head_dim: int) -> RecordLayout:
        planes = []
        for side in ("k", "v"):
            fmt = self.side_format(side, head_dim)
            names = ("data", "scale")
            planes += [PlaneSpec(f"{side}_{nm}", side, b) for nm, b in zip(names, fmt.plane_bytes(head_dim))]
        return RecordLayout(head_dim, tuple(planes))

    def page_geometry(self, head_dim: int, kv_heads: int, layers: int = 1,
                      page_tokens: int = PAGE_TOKENS) -> PageGeometry:
        return PageGeometry(self.layout(head_dim), kv_heads, layers, page_tokens)

    def quantize(self, x, side, global_scale=None):
        from hpc_kernels import kv_quant_ref

        return kv_quant_ref.quantize(self.side_format(side, x.shape[-1]), x, global_scale)

    def dequantize(self, planes: Sequence, side, dtype, global_scale=None):
        from hpc_kernels import kv_quant_ref

        head_dim = int(planes[0].shape[-1] / _DATA_BYTES_PER_VALUE[self.side_kinds[side]])
        return kv_quant_ref.dequantize(self.side_format(side, head_dim), planes, dtype, global_scale)


def _fmt(kind: str, group: int = 0):
    from hpc_kernels.kv_quant_ref import SideFormat

    return SideFormat(kind, group)


def _row_group(name: str, head_dim: int) -> int:
    """Values per scale for the "one scale per 256-value row" formats: 256, or the whole head
    when it is shorter (head_dim must then split into equal rows)."""
    rows = max(1, head_dim // 256)
    _check_groups(name, head_dim, head_dim // rows if head_dim % rows == 0 else 256)
    return head_dim // rows


class BF16Profile(_BuiltinProfile):
    name = "bf16"
    aliases = ("bfloat16",)
    description = "bfloat16 K and V, no scales"

    side_kinds = {"k": "bf16", "v": "bf16"}

    def side_format(self, side, head_dim):
        return _fmt("bf16")


class Int8G64Profile(_BuiltinProfile):
    name = "int8-g64"
    aliases = ("int8",)
    description = "int8 codes with one fp16 scale per 64 values, symmetric"

    side_kinds = {"k": "int8", "v": "int8"}

    def side_format(self, side, head_dim):
        _check_groups(self.name, head_dim, 64)
        return _fmt("int8", 64)


class FP8RowProfile(_BuiltinProfile):
    name = "fp8-e4m3fn-row256"
    aliases = ("fp8", "fp8-row256")
    description = "FP8 E4M3FN codes with one fp16 scale per 256-value row"

    side_kinds = {"k": "fp8", "v": "fp8"}

    def side_format(self, side, head_dim):
        _check_groups(self.name, head_dim, min(head_dim, 256))
        return _fmt("fp8", _row_group(self.name, head_dim))


#: Default per-layer NVFP4 global scales (powers of two, so ``block_scale * global`` is exact).
#: A block's UE4M3 scale is normal (full 3-bit precision) for block amax in
#: [6 * g * 2^-6, 6 * g * 448]: K (g = 2^-2) 0.023 .. 672, V (g = 2^-4) 0.0059 .. 168; it only
#: becomes 0 below 6 * g * 2^-10 (K 0.0015, V 0.00037). See docs/kv-profiles.md.
NVFP4_DEFAULT_GLOBAL_SCALE = {"k": 0.25, "v": 0.0625}


def nvfp4_global_scale_for_amax(amax: float) -> float:
    """The smallest power of two ``g`` with ``amax <= 6 * 448 * g``: a calibrated global scale
    for a layer side whose largest absolute value is ``amax`` (never saturates, keeps the most
    precision for small blocks)."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax / (6.0 * 448.0)))


class NVFP4G16Profile(_BuiltinProfile):
    name = "nvfp4-g16"
    aliases = ("nvfp4", "fp4")
    description = "E2M1 nibbles with one UE4M3 scale per 16 values and a per-layer fp32 global scale"
    uses_global_scale = True

    side_kinds = {"k": "nvfp4", "v": "nvfp4"}

    def side_format(self, side, head_dim):
        _check_groups(self.name, head_dim, 16)
        return _fmt("nvfp4", 16)

    def default_global_scale(self, side: str) -> float:
        return NVFP4_DEFAULT_GLOBAL_SCALE[side]


class K8V4Profile(_BuiltinProfile):
    name = "k8v4"
    aliases = ("int8-nvfp4",)
    description = "K as int8 with one fp16 scale per 256 values, V as nvfp4-g16"
    uses_global_scale = True

    side_kinds = {"k": "int8", "v": "nvfp4"}

    def side_format(self, side, head_dim):
        _check_groups(self.name, head_dim, 16)
        if side == "k":
            return _fmt("int8", _row_group(self.name, head_dim))
        return _fmt("nvfp4", 16)

    def default_global_scale(self, side: str) -> float:
        return NVFP4_DEFAULT_GLOBAL_SCALE[side] if side == "v" else 1.0


BUILTIN_PROFILES = (BF16Profile, Int8G64Profile, FP8RowProfile, NVFP4G16Profile, K8V4Profile)


@hpc_cli.hookimpl
def hpc_register_kv_profiles(register):
    for cls in BUILTIN_PROFILES:
        register(cls())
