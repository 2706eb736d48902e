"""HostSlabPool accounting (spec §5.4).

One host allocation of ``host_bytes`` divided into slabs of ``slab_bytes`` (one block bundle
rounded up to 4 KiB). A snapshot image takes ``image_slabs = ceil(image_bytes / slab_bytes)``
slabs, not necessarily contiguous, and a snapshot with a tail one slab more. The memory is
pinned in chunks of at most ``chunk_bytes`` (4 GiB) of whole slabs: a slab never crosses a
chunk. The free list is an index stack (O(1) alloc and free); capacity is ``free_slabs``.

The memory layer may pin the chunks in the background, first chunk first: then only the slabs
below ``ready_slabs`` exist for allocation, and :meth:`HostSlabPool.grow` adds the slabs of the
chunks that became ready (the free list grows; the first slabs still go first). The pool counts
its slabs per use as it assigns and frees them (:meth:`HostSlabPool.slabs_by_use`, O(1)).

This class only accounts: slab ids and owners. The memory layer owns the bytes and maps a slab
id to ``(chunk, offset)`` with :meth:`HostSlabPool.location`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from hpc_cli.cache.ids import SlabId
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

    __slots__ = ("slab_bytes", "image_bytes", "num_slabs", "slabs_per_chunk", "ready_slabs", "high_water", "_free",
                 "_use", "_owner", "_by_use", "_gen")

    def __init__(self, host_bytes: int, slab_bytes: int, image_bytes: int, *,
                 chunk_bytes: int = CHUNK_BYTES, ready_slabs: int | None = None) -> None:
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
        #: slabs ``0 .. ready_slabs-1`` are backed by memory and may be handed out (all of them
        #: unless the memory layer pins the chunks in the background)
        self.ready_slabs = 0
        #: one more than the highest slab ever handed out (the memory layer faults pages in
        #: ahead of it on the CPU)
        self.high_water = 0
        self._free: list[int] = []
        self._use = bytearray(self.num_slabs)  # SlabUse per slab (FREE for slabs not ready yet)
        self._owner: list[Any] = [None] * self.num_slabs
        self._by_use = [0] * len(SlabUse)  # ready slabs per use, kept by alloc/free/set_use
        #: per slab, how many times it was freed: a reader off the worker thread that sees the
        #: same generation before and after copying a slab copied bytes no new owner wrote
        self._gen = [0] * self.num_slabs
        self.grow(self.num_slabs if ready_slabs is None else ready_slabs)

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

    # -- readiness ---------------------------------------------------------------------------
    @property
    def pending_slabs(self) -> int:
        """Slabs whose chunk is not ready yet (never handed out)."""
        return self.num_slabs - self.ready_slabs

    def grow(self, ready_slabs: int) -> int:
        """Slabs below ``ready_slabs`` are now backed by memory: put the new ones on the free
        stack *under* the free slabs already there (a fresh pool still hands out slab 0 first,
        then 1, ...). Returns how many slabs were added."""
        ready = min(max(ready_slabs, self.ready_slabs), self.num_slabs)
        added = ready - self.ready_slabs
        if added:
            self._free[0:0] = range(ready - 1, self.ready_slabs - 1, -1)
            self._by_use[SlabUse.FREE] += added
            self.ready_slabs = ready
        return added

    # -- accounting -------------------------------------------------------------------------
    @property
    def free_slabs(self) -> int:
        return len(self._free)

    def slabs_by_use(self) -> dict[str, int]:
        """Ready slabs per use (``free``, ``node``, ``image``, ``tail``), uses with none left out;
        O(1) (counted as slabs are assigned and freed)."""
        return {u.name.lower(): n for u, n in zip(SlabUse, self._by_use) if n}

    def recount_by_use(self) -> dict[str, int]:
        """:meth:`slabs_by_use` counted from the slabs themselves (a pass over one byte per slab)."""
        used = self._use[:self.ready_slabs]
        return {u.name.lower(): n for u in SlabUse if (n := used.count(u))}

    def alloc(self, k: int, use: SlabUse, owner: Any) -> list[SlabId] | None:
        """Take ``k`` slabs for ``owner`` or None (nothing taken) when fewer are free."""
        free = self._free
        if k > len(free):
            return None
        out = free[len(free) - k:]
        del free[len(free) - k:]
        out.reverse()
        assert use != SlabUse.FREE, "alloc into FREE makes no sense"
        u, o = self._use, self._owner
        for s in out:
            u[s] = use
            o[s] = owner
        if out:
            self.high_water = max(self.high_water, max(out) + 1)
        self._by_use[SlabUse.FREE] -= k
        self._by_use[use] += k
        return out

    def free(self, slabs: list[SlabId] | tuple[SlabId, ...]) -> None:
        u, o, free, by_use = self._use, self._owner, self._free, self._by_use
        for s in slabs:
            was = u[s]
            assert was != SlabUse.FREE, f"slab {s} freed twice"
            u[s] = SlabUse.FREE
            o[s] = None
            self._gen[s] += 1
            free.append(s)
            by_use[was] -= 1
        by_use[SlabUse.FREE] += len(slabs)

    def set_use(self, slab: SlabId, use: SlabUse) -> None:
        was = self._use[slab]
        assert was != SlabUse.FREE and use != SlabUse.FREE, f"set_use on free slab {slab}"
        self._use[slab] = use
        self._by_use[was] -= 1
        self._by_use[use] += 1

    def generation(self, slab: int) -> int:
        """How many times ``slab`` was freed (its content is another owner's once this changes)."""
        return self._gen[slab]

    def use_of(self, slab: int) -> SlabUse:
        return SlabUse(self._use[slab])

    def owner_of(self, slab: int) -> Any:
        return self._owner[slab]

    def check(self) -> None:
        """Every slab is free xor owned (spec §10.1); the free stack holds exactly the free ready
        ones; slabs not ready are free and unowned; the per-use counts match a recount."""
        free = self._free
        ready = self.ready_slabs
        assert 0 <= ready <= self.num_slabs, f"host pool: {ready} ready slabs of {self.num_slabs}"
        assert len(set(free)) == len(free), "host pool: a slab is on the free stack twice"
        for s in free:
            assert 0 <= s < ready, f"host pool: slab {s} on the free stack but not ready ({ready} ready)"
            assert self._use[s] == SlabUse.FREE, f"host pool: slab {s} on the free stack but in use"
        used = self._use[:ready]
        recount = [used.count(u) for u in SlabUse]
        assert recount[SlabUse.FREE] == len(free), \
            f"host pool: {recount[SlabUse.FREE]} free ready slabs but {len(free)} on the free stack"
        assert recount == self._by_use, f"host pool: slabs by use {self._by_use}, recount {recount}"
        assert not any(self._use[ready:]), "host pool: a slab that is not ready yet is in use"
        for s in range(self.num_slabs):
            assert (self._use[s] == SlabUse.FREE) == (self._owner[s] is None), \
                f"host pool: slab {s} use {self._use[s]} disagrees with owner {self._owner[s]!r}"
