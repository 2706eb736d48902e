"""The binding of cache mode ``off``: the null object of :class:`~hpc_cli.engine.binding.CacheBinding`.

Every lane gets private pages and a reset state; nothing is matched, captured, kept or
transferred, and every request prefills from the root. Other bindings reuse it for requests they
do not cache (disabled requests) through :meth:`OffBinding.admit_plain` and :meth:`release`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from hpc_cli.cache.ids import StateSlot
from hpc_cli.engine.binding import Admission, BindingContext, Blocked, admissible_pages, start_from_root
from hpc_cli.engine.stats_types import CacheStats, Residency
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool, PageState

if TYPE_CHECKING:
    from hpc_cli.model.model import TapImage
    from hpc_cli.engine.lane import Lane


class OffBinding:
    mode = "off"
    persistent = False
    reuse = False

    def __init__(self, context: BindingContext) -> None:
        self.context = context
        self.storage = context.storage
        self.states = context.states
        self.C = context.lanes
        self.pool = DeviceKVPool(context.storage)
        # a host tier of no slabs: the engine pins and stops it like any other
        self.host = HostSlabStorage(BundleLayout.for_storage(context.storage, context.backend_storage).slab_bytes, 0)
        self.free_active = [StateSlot(s) for s in range(self.C - 1, -1, -1)]
        self.counters: dict[str, int] = {"taps": 0, "blocked": 0}
        self.failed: str | None = None

    # ------------------------------------------------------------------ admission
    def admit(self, lane: "Lane", siblings: Sequence["Lane"] = ()) -> Admission:
        return self.admit_plain(lane)

    def admit_plain(self, lane: "Lane") -> Admission:
        """Private pages for the lane's whole entitlement and a reset state; Blocked when the
        pages or lanes are taken."""
        ent = admissible_pages(lane, len(self.free_active), self.pool.num_pages)
        self.make_room(ent)
        if ent > self.pool.num_free:
            self.counters["blocked"] += 1
            raise Blocked("pages held by active lanes")
        start_from_root(lane, self.pool.alloc(ent, PageState.ACTIVE), self.free_active.pop(), self.states)
        return Admission(0, 0, 0)

    def make_room(self, pages: int) -> None:
        """Free cached pages until ``pages`` are free, if the mode keeps any (none here)."""

    def prefetch(self, lane: "Lane") -> int:
        return 0

    # ------------------------------------------------------------------ passes
    def next_stop(self, lane: "Lane", end: int) -> int:
        return end

    def pass_taps(self, lane: "Lane", end: int) -> list[int]:
        return []

    def before_pass(self, lane: "Lane", end: int) -> None:
        pass

    def layer_ready(self, lane: "Lane") -> Callable[[int], None] | None:
        return None

    def after_pass(self, lane: "Lane", tapped: Sequence["TapImage"] = ()) -> None:
        pass

    def commit_blocks(self, lane: "Lane") -> None:
        pass

    # ------------------------------------------------------------------ finish
    def finish(self, lane: "Lane", *, publish: bool = True) -> None:
        self.release(lane)

    def release(self, lane: "Lane") -> None:
        """Free the lane's own pages and give its state slot back."""
        own = [p for p, o in zip(lane.pages, lane.owned) if o]
        if own:
            self.pool.free(own)
        lane.pages, lane.owned = [], []
        if lane.state_slot >= 0:
            self.free_active.append(lane.state_slot)
            lane.state_slot = StateSlot(-1)

    # ------------------------------------------------------------------ transfers (none)
    @property
    def transfers_pending(self) -> int:
        return 0

    def poll(self) -> None:
        pass

    def drain(self) -> None:
        pass

    # ------------------------------------------------------------------ checks and stats
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        assert len(set(self.free_active)) == len(self.free_active) <= self.C, "lane slots broken"

    def leftovers(self) -> dict[str, int]:
        return {"active_pages": self.pool.num_active, "filling_pages": self.pool.num_filling,
                "lanes_out": self.C - len(self.free_active), "transfers_pending": self.transfers_pending}

    def residency(self) -> Residency:
        return Residency()

    def stats(self, *, detailed: bool = False) -> CacheStats:
        return CacheStats(mode=self.mode, pool=self.pool.counts(), pages=self.pool.num_pages,
                          lanes_free=len(self.free_active), host_slabs=0, slab_bytes=self.host.slab_bytes,
                          page_bytes=self.storage.page_bytes, image_bytes=self.states.image_bytes,
                          transfers_pending=0, residency=self.residency(), counters=dict(self.counters))
