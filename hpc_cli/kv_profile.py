"""The KV profile contract: how one token's K and V of one KV head are stored (spec §3.1, §11.2).

A KV profile names itself and gives its *record layout* for a head dimension: per token per KV
head, a K part and a V part, each made of planes (data and scales kept in separate planes so
data rows stay 16-byte aligned). Pools store one tensor per (layer, plane) of shape
``[pages, 64, kv_heads, plane_bytes]`` in ``uint8``; a host slab packs a block's planes back to
back, so a device -> host -> device round trip is a pure byte copy and bit-exact.

Plugins register profiles through the ``hpc_register_kv_profiles(register)`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # torch is imported lazily so `hpc-cli plugins` stays fast
    import torch

SIDES = ("k", "v")
#: tokens per KV page: one cache block, ``hpc_cli.cache.keys.BLOCK_TOKENS`` (the cache imports
#: nothing of ours but errors, so the memory layer keeps its own name; tests/cache/test_keys.py)
PAGE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """One plane of a record: ``bytes_per_token_head`` bytes for each token and KV head."""

    name: str  # e.g. "k_data", "k_scale", "v_data", "v_scale"
    side: str  # "k" or "v"
    bytes_per_token_head: int


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """The bytes one token of one KV head takes, plane by plane."""

    head_dim: int
    planes: tuple[PlaneSpec, ...]

    def side_planes(self, side: str) -> tuple[PlaneSpec, ...]:
        return tuple(p for p in self.planes if p.side == side)

    def side_bytes(self, side: str) -> int:
        return sum(p.bytes_per_token_head for p in self.side_planes(side))

    @property
    def k_bytes(self) -> int:
        return self.side_bytes("k")

    @property
    def v_bytes(self) -> int:
        return self.side_bytes("v")

    @property
    def bytes_per_token_head(self) -> int:
        return sum(p.bytes_per_token_head for p in self.planes)

    def page_bytes(self, kv_heads: int, layers: int = 1, page_tokens: int = PAGE_TOKENS) -> int:
        """Bytes of one page (``page_tokens`` tokens) over ``layers`` attention layers."""
        return self.bytes_per_token_head * kv_heads * layers * page_tokens


class KVProfile:
    """Base class of a KV storage profile. Subclasses set the class attributes and implement
    :meth:`layout`, :meth:`quantize` and :meth:`dequantize`.

    ``quantize`` maps float values ``[N, H, D]`` of one side to that side's planes, each a
    ``uint8`` tensor ``[N, H, plane_bytes]``; ``dequantize`` is its inverse up to the profile's
    rounding. Both must be deterministic and give the same bytes on every device (a GPU kernel
    may replace the torch reference where it gives identical codes).
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""
    #: True when the profile keeps a per-layer fp32 global scale for K and one for V (NVFP4).
    uses_global_scale: bool = False

    def layout(self, head_dim: int) -> RecordLayout:
        raise NotImplementedError

    def quantize(self, x: "torch.Tensor", side: str,
                 global_scale: "torch.Tensor | None" = None) -> list["torch.Tensor"]:
        raise NotImplementedError

    def dequantize(self, planes: Sequence["torch.Tensor"], side: str, dtype: "torch.dtype",
                   global_scale: "torch.Tensor | None" = None) -> "torch.Tensor":
        raise NotImplementedError

    def default_global_scale(self, side: str) -> float:
        """The global scale a pool starts with (only for profiles with ``uses_global_scale``)."""
        return 1.0

    def __repr__(self) -> str:
        return f"<KVProfile {self.name}>"
