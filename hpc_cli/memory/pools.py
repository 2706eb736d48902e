"""Device pools with page and slot accounting (spec §5.4, §9.1-9.2).

:class:`DeviceKVPool` puts page states on top of one :class:`PagedKVStorage` (the main pool, or
a speculative backend's own pool): every page is in exactly one state, Free, Active (owned by
one sequence, private), Cached (owned by a node or snapshot tail) or Filling (a transfer
destination). ``available = free + evictable cached``; what is evictable is the cache index's
knowledge, asked through the ``evictable`` callback.

:class:`StatePool` splits a :class:`StateSlots` into C active slots and D snapshot slots; a tap
(one image into a snapshot slot) is :meth:`StatePool.copy_image`, a handful of device copies.
The engine does not use it: the cache binding keeps the lanes' free slots and the index hands
out the snapshot slots.

Both free lists are index stacks: alloc and free are O(1) per id; the lowest id goes first.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Callable, Iterable, Sequence

import torch

from hpc_cli.errors import CapacityError
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots


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

    def counts(self) -> dict[str, int]:
        return {s.name.lower(): self._counts[s] for s in PageState}

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


class StatePool:
    """C active slots (``0..C-1``) and D snapshot slots (``C..C+D-1``) of one StateSlots."""

    def __init__(self, slots: StateSlots, active: int, snapshot: int) -> None:
        assert active >= 1 and snapshot >= 0, f"need C >= 1 and D >= 0, got C={active} D={snapshot}"
        assert slots.num_slots == active + snapshot, \
            f"StateSlots has {slots.num_slots} slots, C + D = {active + snapshot}"
        self.slots = slots
        self.num_active = active
        self.num_snapshot = snapshot
        self._free_active = list(range(active - 1, -1, -1))
        self._free_snapshot = list(range(active + snapshot - 1, active - 1, -1))
        self._used: set[int] = set()

    @classmethod
    def create(cls, *, num_gdn_layers: int, conv_dim: int, conv_width: int, num_v_heads: int,
               key_head_dim: int, value_head_dim: int, hidden_size: int, active: int, snapshot: int,
               dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
               extra_parts=None) -> "StatePool":
        try:
            slots = StateSlots(num_gdn_layers, conv_dim, conv_width, num_v_heads, key_head_dim,
                               value_head_dim, hidden_size, active + snapshot, dtype, device, extra_parts)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise CapacityError(f"cannot allocate {active + snapshot} state slots on {device}: {exc}",
                                hint="lower device_snapshot_slots or the concurrency") from exc
        return cls(slots, active, snapshot)

    @property
    def free_active(self) -> int:
        return len(self._free_active)

    @property
    def free_snapshot(self) -> int:
        return len(self._free_snapshot)

    def is_snapshot_slot(self, slot: int) -> bool:
        return self.num_active <= slot < self.num_active + self.num_snapshot

    def alloc_active(self) -> int:
        if not self._free_active:
            raise CapacityError(f"all {self.num_active} active state slots are in use",
                                hint="lanes are limited by the concurrency setting")
        s = self._free_active.pop()
        self._used.add(s)
        return s

    def alloc_snapshot(self) -> int | None:
        """A free snapshot slot, or None (the caller evicts a device snapshot, spec §9.2)."""
        if not self._free_snapshot:
            return None
        s = self._free_snapshot.pop()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        assert slot in self._used, f"state slot {slot} is not in use"
        self._used.discard(slot)
        (self._free_snapshot if self.is_snapshot_slot(slot) else self._free_active).append(slot)

    def copy_image(self, src: int, dst: int) -> None:
        """Copy one image between slots on the current stream (a tap or a resume)."""
        self.slots.copy_slot(src, dst)

    def reset(self, slot: int) -> None:
        self.slots.reset(slot)

    def used(self) -> Sequence[int]:
        return sorted(self._used)
