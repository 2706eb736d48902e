"""Device pools with page and slot accounting (spec §5.4, §9.1-9.2).

:class:`DeviceKVPool` puts page states on top of one :class:`PagedKVStorage` (the main pool, or
a speculative backend's own pool): every page is in exactly one state, Free, Active (owned by
one sequence, private), Cached (owned by a node or snapshot tail) or Filling (a transfer
destination). ``available = free + evictable cached``; what is evictable is the cache index's
knowledge, asked through the ``evictable`` callback.

State slots have no pool of their own: the cache binding keeps the lanes' free slots and the
index hands out the snapshot slots (``acquire_snapshot_slot``); a tap is one
:meth:`StateSlots.copy_slot`.

The free list is an index stack: alloc and free are O(1) per id; the lowest id goes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Iterable

from hpc_cli.errors import CapacityError
from hpc_cli.memory.kv_pool import PagedKVStorage


class PageState(IntEnum):
    FREE = 0
    ACTIVE = 1
    CACHED = 2
    FILLING = 3


#: allowed state changes besides alloc (FREE -> any) and free (any but FILLING -> FREE)
_TRANSITIONS: dict[PageState, frozenset[PageState]] = {
    PageState.ACTIVE: frozenset({PageState.CACHED}),    # block commit: the node adopts the page
    PageState.FILLING: frozenset({PageState.CACHED}),   # the restore landed
    PageState.CACHED: frozenset({PageState.FILLING}),   # a cached page re-filled from the host
}


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """Pages by state (:meth:`DeviceKVPool.counts`), in :class:`PageState`'s order; its JSON is
    ``cache.pool`` of the engine's stats."""

    free: int
    active: int
    cached: int
    filling: int


class DeviceKVPool:
    """Page-state accounting over one pool's storage.

    ``evictable`` returns how many Cached pages the index could evict now (unpinned, backed up
    or deliberately discardable); without it no cached page counts as available.
    """

    def __init__(self, storage: PagedKVStorage, evictable: Callable[[], int] | None = None) -> None:
        self.storage = storage
        self.name = storage.name
        self.num_pages = storage.num_pages
        self.evictable = evictable
        self._state = bytearray(self.num_pages)  # PageState per page
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._counts = [self.num_pages, 0, 0, 0]

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._counts[PageState.FREE]

    @property
    def num_active(self) -> int:
        return self._counts[PageState.ACTIVE]

    @property
    def num_cached(self) -> int:
        return self._counts[PageState.CACHED]

    @property
    def num_filling(self) -> int:
        return self._counts[PageState.FILLING]

    @property
    def available(self) -> int:
        """Free pages plus the cached pages the index says it can evict."""
        ev = self.evictable() if self.evictable is not None else 0
        assert 0 <= ev <= self.num_cached, f"pool {self.name}: {ev} evictable of {self.num_cached} cached"
        return self.num_free + ev

    def counts(self) -> PoolCounts:
        return PoolCounts(*self._counts)

    def state(self, page: int) -> PageState:
        return PageState(self._state[page])

    # -- changes --------------------------------------------------------------------------
    def try_alloc(self, n: int, state: PageState = PageState.ACTIVE) -> list[int] | None:
        """Take ``n`` free pages into ``state``, lowest ids first, or None (nothing taken)."""
        assert state != PageState.FREE, "alloc into FREE makes no sense"
        if n > len(self._free):
            return None
        free = self._free
        out = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        for p in out:
            self._state[p] = state
        self._counts[PageState.FREE] -= n
        self._counts[state] += n
        return out

    def alloc(self, n: int, state: PageState = PageState.ACTIVE) -> list[int]:
        """Like :meth:`try_alloc`; too few free pages is a :class:`CapacityError`."""
        out = self.try_alloc(n, state)
        if out is None:
            raise CapacityError(
                f"device KV pool {self.name!r} has {self.num_free} free pages of {self.num_pages}, "
                f"{n} needed", hint="evict cached pages first, or raise the KV capacity")
        return out

    def set_state(self, pages: Iterable[int], state: PageState) -> None:
        """Move pages between used states (Active -> Cached, Filling -> Cached, Cached -> Filling)."""
        for p in pages:
            old = PageState(self._state[p])
            assert state in _TRANSITIONS.get(old, ()), f"pool {self.name}: page {p} {old.name} -> {state.name}"
            self._state[p] = state
            self._counts[old] -= 1
            self._counts[state] += 1

    def land(self, pages: Iterable[int]) -> None:
        """A restore into ``pages`` completed: Filling -> Cached."""
        self.set_state(pages, PageState.CACHED)

    def free(self, pages: Iterable[int], *, abandon_filling: bool = False) -> None:
        """Return pages to the free stack. A Filling page may only be freed with
        ``abandon_filling`` (its transfer completed or failed and nothing reads it)."""
        for p in pages:
            old = PageState(self._state[p])
            assert old != PageState.FREE, f"pool {self.name}: page {p} freed twice"
            assert old != PageState.FILLING or abandon_filling, \
                f"pool {self.name}: page {p} is a transfer destination (Filling)"
            self._state[p] = PageState.FREE
            self._counts[old] -= 1
            self._counts[PageState.FREE] += 1
            self._free.append(p)

    def check_invariants(self) -> None:
        counts = [0, 0, 0, 0]
        for s in self._state:
            counts[s] += 1
        assert counts == self._counts, f"pool {self.name}: counts {self._counts} != {counts}"
        assert len(self._free) == counts[PageState.FREE] == len(set(self._free)), "free stack broken"
        assert all(self._state[p] == PageState.FREE for p in self._free), "a used page on the free stack"
