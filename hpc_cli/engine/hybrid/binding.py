"""The hybrid binding: the prefix index, the device pools, the host tier and the transfer engine
working for the engine's lanes (spec §6.4-6.5, §7.4-7.7, §9.1; ARCHITECTURE.md §4).

The engine calls, in a request's order: :meth:`admit` (quote, stage, restore, activate; or
wait: a blocked head is prefetched, a head sharing a prefilling lane's prefix coalesces;
:mod:`.restore`), :meth:`before_pass` / :meth:`after_pass` around every prefill pass and
:meth:`commit_blocks` after decode rounds (:mod:`.commit`), :meth:`finish` at terminal settlement
(endpoint snapshot, release, write-through; :mod:`.publish`), and :meth:`poll` to land transfers
(:mod:`.transfers`). The contract is :mod:`hpc_cli.engine.binding`; cache mode ``off`` is
:mod:`hpc_cli.engine.off`. With ``reuse=False`` and for disabled requests nothing is matched,
committed or published: lanes get private pages and a reset state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import CacheGeometry
from hpc_cli.cache.stats import InflightBytes, snapshot_rows
from hpc_cli.cache.taps import TapPlanner
from hpc_cli.cache.ids import StateSlot
from hpc_cli.engine.stats_types import HybridCacheStats, Residency
from hpc_cli.engine.hybrid.commit import Commit
from hpc_cli.engine.hybrid.publish import Publish
from hpc_cli.engine.hybrid.restore import Restore
from hpc_cli.engine.hybrid.transfers import Transfers
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool, PageState
from hpc_cli.memory.transfer.engine import TransferEngine

if TYPE_CHECKING:
    from hpc_cli.engine.shared import SharedTier


class HybridBinding(Restore, Commit, Publish, Transfers):
    """The hybrid mode's binding (see the module doc)."""

    mode = "hybrid"
    persistent = True  # the prefix cache file (spec §5.5) loads into and saves from its host tier
    #: how long construction waits for the host tier's first chunk (allocation is lazy on the
    #: CPU, so it is there at once; a pinned 4 GiB chunk takes ~1.5 s on an H200 and joins later)
    FIRST_CHUNK_WAIT_S = 0.1

    def __init__(self, model: Any, storage: Any, states: Any, *, lanes: int, snapshot_slots: int,
                 host_bytes: int, reuse: bool, planner: TapPlanner, transfer_factory=None,
                 coalesce: bool = False, coalesce_wait_limit: float = 300.0,
                 backend_storage: Any = None, frontier_lag: int = 0, tap_slots: int = 0) -> None:
        self.model = model
        self.storage = storage
        # a speculative backend's own pool (DFlash: same page ids as the main pool) and how far its
        # committed frontier may trail the text frontier (MTP: 1; lane.backend_frontier is exact)
        self.backend_storage = backend_storage
        self.frontier_lag = frontier_lag
        self.states = states
        self.reuse = reuse
        self.planner = planner
        self.coalesce = coalesce and reuse
        self.coalesce_wait_limit = coalesce_wait_limit  # seconds: half the queue timeout
        self._prefetch = None  # the open prefetch's ticket (one at a time)
        self._prefetch_last: tuple[str, int] | None = None
        self.C = lanes
        self.D = snapshot_slots if reuse else 0
        self.layout = BundleLayout.for_storage(storage, backend_storage)
        slab = self.layout.slab_bytes
        image_bytes = states.image_bytes
        num_slabs = host_bytes // slab if (reuse and host_bytes) else 0
        # the host tier is allocated and pinned in the background, first chunk first (§5.4);
        # the slabs of each chunk join the index at the first poll() after it is ready (the
        # engine sets host.on_ready to wake its worker for that)
        self.host = HostSlabStorage(slab, num_slabs, background=True)
        self.host.wait_ready(self.host.slabs_per_chunk, timeout=self.FIRST_CHUNK_WAIT_S)
        self.index = PrefixIndex(CacheGeometry(block_bytes=self.layout.record_bytes, image_bytes=image_bytes,
                                               device_snapshot_slots=self.D, host_bytes=num_slabs * slab,
                                               slab_bytes=slab), host_ready_slabs=self.host.ready_slabs)
        self.pool = DeviceKVPool(storage, evictable=self.index.evictable_pages)
        make = transfer_factory or TransferEngine
        from hpc_cli.memory.transfer.plan import layer_order_for_shape

        self.transfer = make(storage, self.host, state=states, layer_order=layer_order_for_shape(model.shape()),
                             **({"backend": backend_storage} if backend_storage is not None else {}))
        self.free_active = [StateSlot(s) for s in range(lanes - 1, -1, -1)]
        self.snap_phys = [StateSlot(lanes + k) for k in range(self.D)]  # index snapshot slot -> state slot
        # the state slots a pass writes its taps' images into, one per exact tap a pass takes itself
        # (the mode asks for the model's capacity, none with a speculative backend, whose state
        # parts a pass does not tap); a published image's slot becomes its snapshot's, and the
        # slot that snapshot held takes its place here (no copy)
        self.tap_scratch = [StateSlot(lanes + snapshot_slots + j) for j in range(tap_slots)]
        self.jobs: dict[int, tuple[str, Any]] = {}  # transfer job id -> (kind, index batch)
        self.failed: str | None = None
        # taps_in_pass: taps whose image a prefill pass took inside itself (published by handing
        # over a tap slot; they count in taps too)
        self.counters = {"restored_host_bytes": 0, "taps": 0, "taps_in_pass": 0, "taps_skipped": 0,
                         "endpoints": 0, "transfer_failures": 0, "blocked": 0, "coalesce_waits": 0,
                         "prefetched_blocks": 0, "prefetched_bytes": 0}
        self.shared: "SharedTier | None" = None  # the shared tier (L3), hpc_cli.engine.shared

    # ------------------------------------------------------------------ sizes
    @property
    def image_bytes(self) -> int:
        return self.states.image_bytes

    # ------------------------------------------------------------------ checks and stats
    def check_invariants(self) -> None:
        # state slots change hands (an endpoint's or a tap's slot becomes its snapshot's), but a
        # slot is a snapshot's, a tap slot, a free lane slot or a lane's, one at a time
        held = [*self.snap_phys, *self.tap_scratch, *self.free_active]
        assert len(set(held)) == len(held) and all(0 <= s < self.states.num_slots for s in held), \
            f"state slots held twice: snapshots {self.snap_phys}, tap slots {self.tap_scratch}, free {self.free_active}"
        owned = self.index.check_invariants()[0]
        self.pool.check_invariants()
        # the pool's cached and filling pages are exactly the index's (its blocks and snapshot
        # tails; the lanes hold the active ones): a page the index does not know is lost to
        # admission for good, one it owns but the pool does not hold can be handed out twice
        held = {p for p in range(self.pool.num_pages) if self.pool.state(p) in (PageState.CACHED, PageState.FILLING)}
        assert held == owned, (f"device pages held by the pool but owned by no block or tail: {sorted(held - owned)[:16]}; "
                               f"owned by the index but not held: {sorted(owned - held)[:16]}")

    def stats(self, *, detailed: bool = False) -> HybridCacheStats:
        """The cache's stats from running counts (O(1): the worker publishes them a few times a
        second and /metrics exports them). ``detailed`` adds what takes a walk, the snapshot
        table (``top_snapshots``): only for a client's request, served by the worker."""
        t = self.index.tally
        return HybridCacheStats(
            index=self.index.stats(), pool=self.pool.counts(), pages=self.pool.num_pages, snapshot_slots=self.D,
            lanes_free=len(self.free_active), host_slabs=self.host.num_slabs, slab_bytes=self.host.slab_bytes,
            host_tier=self.host.progress(), page_bytes=self.storage.page_bytes, image_bytes=self.image_bytes,
            transfers_pending=self.transfer.pending, inflight=InflightBytes(t.restore_bytes, t.write_bytes),
            counters=dict(self.counters), shared=self.shared.stats() if self.shared is not None else None,
            residency=self.residency(), top_snapshots=snapshot_rows(self.index, 16) if detailed else None)

    def residency(self) -> Residency:
        """Bytes held on the device (cached blocks, snapshot images) and the host, and the
        snapshots alive (running counts)."""
        doc = self.index.stats()
        dev, host = doc.device, doc.host
        return Residency(device_kv_bytes=dev.block_bytes_cached, device_state_bytes=dev.image_bytes_cached,
                         host_bytes=(host.ready_slabs - host.free_slabs) * host.slab_bytes,
                         entries=doc.snapshots.total)

    def leftovers(self) -> dict[str, int]:
        """What is still held (all zero once the engine stopped): pins, sequences, active and
        filling pages, restore pins of snapshots, lanes out, transfers in flight."""
        st = self.index.stats()
        return {"pinned_nodes": st.nodes.pinned, "sequences": st.sequences,
                "filling_nodes": sum(st.nodes.filling.values()), "active_pages": self.pool.num_active,
                "filling_pages": self.pool.num_filling, "lanes_out": self.C - len(set(self.free_active)),
                "snapshot_restore_pins": sum(s.restore_pins for s in self.index.snapshots.values()),
                "transfers_pending": self.transfer.pending}
