"""HostSlabPool accounting (spec §5.4).

One host allocation of ``host_bytes`` divided into slabs of ``slab_bytes`` (one block bundle
rounded up to 4 KiB). A snapshot image takes ``image_slabs = ceil(image_bytes / slab_bytes)``
slabs, not necessarily contiguous, and a snapshot with a tail one slab more. The memory is
pinned in chunks of at most ``chunk_bytes`` (4 GiB) of whole slabs: a slab never crosses a
chunk. The free list is an index stack (O(1) alloc and free); capacity is ``free_slabs``.

This class only accounts: slab ids and owners. The memory layer owns the bytes and maps a slab
id to ``(chunk, offset)`` with :meth:`HostSlabPool.location`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from hpc_cli.errors import CapacityError

CHUNK_BYTES = 4 << 30
SLAB_ALIGN = 4096


class SlabUse(IntEnum):
    """What a slab holds (spec §10.1: Free/Node/SnapshotImage/SnapshotTail; Filling is the
    owner's host_state)."""

    FREE = 0
    NODE = 1
    IMAGE = 2
    TAIL = 3


def image_slabs(image_bytes: int, slab_bytes: int) -> int:
    """Slabs one snapshot image occupies: ``ceil(image_bytes / slab_bytes)``."""
    return -(-image_bytes // slab_bytes)


def round_slab(record_bytes: int) -> int:
    """A block bundle's host record rounded up to 4 KiB: the slab size."""
    return -(-record_bytes // SLAB_ALIGN) * SLAB_ALIGN


class HostSlabPool:
    """Slab ids ``0 .. num_slabs-1``; ``alloc`` and ``free`` are O(1) per slab."""

    __slots__ = ("slab_bytes", "image_bytes", "num_slabs", "slabs_per_chunk", "_free", "_use", "_owner")

    def __init__(self, host_bytes: int, slab_bytes: int, image_bytes: int, *,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if slab_bytes <= 0:
            raise CapacityError(f"slab size must be positive, got {slab_bytes}")
        if host_bytes < 0:
            raise CapacityError(f"host cache size must not be negative, got {host_bytes}")
        if 0 < chunk_bytes < slab_bytes:
            raise CapacityError(f"a pinned chunk of {chunk_bytes} B cannot hold one {slab_bytes} B slab")
        self.slab_bytes = slab_bytes
        self.image_bytes = image_bytes
        self.num_slabs = host_bytes // slab_bytes
        self.slabs_per_chunk = max(1, chunk_bytes // slab_bytes)
        need = image_slabs(image_bytes, slab_bytes) + 1
        if host_bytes > 0 and self.num_slabs < need:
            mib = -(-need * slab_bytes // (1 << 20))
            raise CapacityError(
                f"host cache of {host_bytes} B holds {self.num_slabs} slabs, fewer than one snapshot "
                f"plus one block ({need} slabs of {slab_bytes} B)",
                hint=f"set --host-cache-mib to at least {mib}, or 0 to run without a host tier")
        # Pop from the end: slab 0 is handed out first, so a fresh pool fills in order.
        self._free: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self._use = bytearray(self.num_slabs)  # SlabUse per slab
        self._owner: list[Any] = [None] * self.num_slabs

    # -- geometry ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.num_slabs > 0

    @property
    def image_slabs(self) -> int:
        return image_slabs(self.image_bytes, self.slab_bytes)

    @property
    def num_chunks(self) -> int:
        return -(-self.num_slabs // self.slabs_per_chunk) if self.num_slabs else 0

    def chunk_sizes(self) -> list[int]:
        """Bytes of each pinned chunk (whole slabs; the last may be smaller)."""
        out = []
        left = self.num_slabs
        while left > 0:
            k = min(left, self.slabs_per_chunk)
            out.append(k * self.slab_bytes)
            left -= k
        return out

    def location(self, slab: int) -> tuple[int, int]:
        """``(chunk index, byte offset in the chunk)`` of a slab."""
        assert 0 <= slab < self.num_slabs, f"slab {slab} out of range 0..{self.num_slabs - 1}"
        c, i = divmod(slab, self.slabs_per_chunk)
        return c, i * self.slab_bytes

    def same_chunk(self, a: int, b: int) -> bool:
        return a // self.slabs_per_chunk == b // self.slabs_per_chunk

    # -- accounting -------------------------------------------------------------------------
    @property
    def free_slabs(self) -> int:
        return len(self._free)

    @property
    def used_slabs(self) -> int:
        return self.num_slabs - len(self._free)

    def alloc(self, k: int, use: SlabUse, owner: Any) -> list[int] | None:
        """Take ``k`` slabs for ``owner`` or None (nothing taken) when fewer are free."""
        free = self._free
        if k > len(free):
            return None
        out = free[len(free) - k:]
        del free[len(free) - k:]
        out.reverse()
        u, o = self._use, self._owner
        for s in out:
            u[s] = use
            o[s] = owner
        return out

    def free(self, slabs: list[int] | tuple[int, ...]) -> None:
        u, o, free = self._use, self._owner, self._free
        for s in slabs:
            assert u[s] != SlabUse.FREE, f"slab {s} freed twice"
            u[s] = SlabUse.FREE
            o[s] = None
            free.append(s)

    def set_use(self, slab: int, use: SlabUse) -> None:
        assert self._use[slab] != SlabUse.FREE and use != SlabUse.FREE, f"set_use on free slab {slab}"
        self._use[slab] = use

    def use_of(self, slab: int) -> SlabUse:
        return SlabUse(self._use[slab])

    def owner_of(self, slab: int) -> Any:
        return self._owner[slab]

    def check(self) -> None:
        """Every slab is free xor owned (spec §10.1); the free stack holds exactly the free ones."""
        free = self._free
        assert len(set(free)) == len(free), "host pool: a slab is on the free stack twice"
        for s in free:
            assert self._use[s] == SlabUse.FREE, f"host pool: slab {s} on the free stack but in use"
        nfree = sum(1 for u in self._use if u == SlabUse.FREE)
        assert nfree == len(free), f"host pool: {nfree} free slabs but {len(free)} on the free stack"
        for s in range(self.num_slabs):
            assert (self._use[s] == SlabUse.FREE) == (self._owner[s] is None), \
                f"host pool: slab {s} use {self._use[s]} disagrees with owner {self._owner[s]!r}"
