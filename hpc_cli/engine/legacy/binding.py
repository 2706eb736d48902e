"""The binding of cache mode ``legacy``: the checkpoint catalog (:mod:`hpc_cli.cache.catalog`) on
the same device pools, state slots, host slabs and transfer engine as the hybrid binding.

- Admission resumes at the deepest owned checkpoint whose owner's path is a prefix of the
  prompt: below it the owner's full pages are shared (reference-counted), a partial last page is
  copied, and the checkpoint's state is copied into the lane's slot; a host-resident owner is
  restored (its blocks into fresh pages, its image into the lane's slot, layer by layer).
- Capture splits the prefill at each checkpoint frontier (spec §1.3): long anchors at multiples
  of ``long_anchor_spacing``, and a shared stable prefix where the prompt leaves another
  session's continuation. The session endpoint is taken at finish: the lane's pages become the
  new continuation's, which replaces the one it resumed from.
- Pressure (pages or state slots short): the least recently used owner is demoted to the host
  (copy before release: the copies are waited for) when ``host_kv_mib`` and ``host_state_slots``
  have room (older host owners go first), else dropped.

Requests the catalog does not handle (disabled, prompt logprobs, images) are served like cache
mode ``off``. A drafting speculative backend is rejected (the mode validates that).

The binding is :mod:`.binding` (pages, slots, prefill captures, transfers, checks and stats);
admission is :mod:`.admission`, publishing and evicting owners :mod:`.owners`, the options
:mod:`.config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from hpc_cli.cache.catalog import Checkpoint, CheckpointCatalog, CheckpointKind, Owner, Residency
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.ids import StateSlot
from hpc_cli.engine.binding import BindingContext
from hpc_cli.engine.stats_types import LegacyCacheStats, Residency as Held
from hpc_cli.engine.legacy.admission import LegacyAdmission
from hpc_cli.engine.legacy.config import LegacyConfig
from hpc_cli.engine.legacy.owners import Owners
from hpc_cli.engine.legacy.parts import LanePlan
from hpc_cli.errors import ConfigError
from hpc_cli.memory.bundle import BundleLayout, image_slab_count
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool, PageState

if TYPE_CHECKING:
    from hpc_cli.engine.lane import Lane
    from hpc_cli.model.model import TapImage

MiB = 1 << 20


class LegacyBinding(LegacyAdmission, Owners):
    """Cache mode legacy's binding (see the module doc)."""

    mode = "legacy"
    persistent = False
    reuse = True
    FIRST_CHUNK_WAIT_S = 0.1

    def __init__(self, context: BindingContext, config: LegacyConfig) -> None:
        if context.speculative or context.backend_storage is not None or context.frontier_lag:
            raise ConfigError("cache mode 'legacy' runs without a speculative backend",
                              hint="set speculative.backend = 'none', or cache.mode = 'hybrid'")
        self.context = context
        self.config = config
        self.storage = context.storage
        self.states = context.states
        self.C = context.lanes
        assert context.snapshot_slots == config.device_state_slots, "state slots allocated for another count"
        self.catalog = CheckpointCatalog(config.limits)
        self.pool = DeviceKVPool(context.storage)
        self.refs = [0] * self.pool.num_pages  # holders of each page: owners and lanes
        self.free_active = [StateSlot(s) for s in range(self.C - 1, -1, -1)]
        self.free_slots = [StateSlot(s) for s in range(self.C + config.device_state_slots - 1, self.C - 1, -1)]
        layout = BundleLayout.for_storage(context.storage)
        self.image_slabs = image_slab_count(self.states.image_bytes, layout.slab_bytes)
        self.kv_slabs = (config.host_kv_mib * MiB) // layout.slab_bytes
        self.host_images = config.host_state_slots if self.kv_slabs else 0
        total = self.kv_slabs + self.host_images * self.image_slabs
        self.host = HostSlabStorage(layout.slab_bytes, total, background=True)
        self.host.wait_ready(self.host.slabs_per_chunk, timeout=self.FIRST_CHUNK_WAIT_S)
        self._host_ready = 0
        self.free_slabs: list[int] = []
        self.host_high = 0
        self.kv_slabs_used = 0
        self.images_used = 0
        self.transfer = context.make_transfer(self.host)
        self.jobs: dict[int, tuple[str, Owner | None]] = {}
        self.plans: dict[Lane, LanePlan] = {}
        self.zombies: list[Owner] = []  # removed owners whose host copies a restore still reads
        self.failed: str | None = None
        self.counters: dict[str, int] = {"taps": 0, "taps_skipped": 0, "endpoints": 0, "blocked": 0,
                                         "restored_host_bytes": 0, "demoted_bytes": 0, "transfer_failures": 0,
                                         "prefill_splits": 0}
        self._grow_host()

    # ------------------------------------------------------------------ pages and slots
    def _incref(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def _decref(self, pages: Sequence[int]) -> None:
        freed = []
        for p in pages:
            self.refs[p] -= 1
            assert self.refs[p] >= 0, f"page {p} released twice"
            if self.refs[p] == 0:
                freed.append(p)
        if freed:
            self.pool.free(freed)

    def _make_room(self, pages: int, exclude: Sequence[Owner] = ()) -> bool:
        """Demote or drop least recently used owners until ``pages`` pages are free."""
        victims = self.catalog.lru(Residency.DEVICE, exclude)
        while self.pool.num_free < pages:
            victim = next(victims, None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _slot(self, exclude: Sequence[Owner] = ()) -> StateSlot | None:
        """A free device state slot, demoting the least recently used owner for one if needed."""
        if not self.free_slots:
            victim = next(self.catalog.lru(Residency.DEVICE, exclude), None)
            if victim is not None:
                self._evict(victim)
        return self.free_slots.pop() if self.free_slots else None

    # ------------------------------------------------------------------ prefill: split at every capture
    def next_stop(self, lane: "Lane", end: int) -> int:
        plan = self.plans.get(lane)
        if plan is not None:
            for p, _ in plan.captures:
                if lane.pos < p < end:
                    self.counters["prefill_splits"] += 1
                    return p
        return end

    def pass_taps(self, lane: "Lane", end: int) -> list[int]:
        return []  # the checkpoint catalog splits at every capture (spec §0: the baseline)

    def before_pass(self, lane: "Lane", end: int) -> None:
        pass

    def layer_ready(self, lane: "Lane") -> Callable[[int], None] | None:
        ticket = lane.ticket
        if ticket is None:
            return None
        lane.ticket = None
        return ticket.wait_layer

    def after_pass(self, lane: "Lane", tapped: Sequence["TapImage"] = ()) -> None:
        plan = self.plans.get(lane)
        if plan is None or not plan.captures or plan.captures[0][0] > lane.pos:
            return
        due = [c for c in plan.captures if c[0] <= lane.pos]
        plan.captures = plan.captures[len(due):]
        for p, kind in due:
            if p != lane.pos:
                continue
            slot = self._slot(exclude=[plan.source] if plan.source is not None else [])
            if slot is None:
                self.counters["taps_skipped"] += 1
                continue
            self.states.copy_slot(lane.state_slot, slot)
            self.counters["taps"] += 1
            if kind is CheckpointKind.LONG_ANCHOR:
                plan.anchors.append(Checkpoint(kind, p, slot=slot))
                continue
            pages = lane.pages[:p // BLOCK_TOKENS]
            self._adopt(lane, pages)
            self.catalog.new_owner(shared=True, salt=lane.prepared.salt, tokens=lane.tokens[:p],
                                   checkpoints=[Checkpoint(kind, p, slot=slot)], pages=pages)
            self._enforce_limits()

    def _adopt(self, lane: "Lane", pages: Sequence[int]) -> None:
        """An owner takes ``pages`` of the lane: one more holder each; lane-private pages turn Cached."""
        self._incref(pages)
        for b, p in enumerate(pages):
            if lane.owned[b]:
                lane.owned[b] = False
                self.pool.set_state([p], PageState.CACHED)

    def commit_blocks(self, lane: "Lane") -> None:
        pass  # the catalog publishes at capture points and at finish, never per block

    # ------------------------------------------------------------------ transfers
    @property
    def transfers_pending(self) -> int:
        return self.transfer.pending

    def _grow_host(self) -> None:
        self.host.fault_ahead(self.host_high)  # CPU: pages faulted in before use
        ready = self.host.ready_slabs
        if ready > self._host_ready:
            self.free_slabs += range(ready - 1, self._host_ready - 1, -1)
            self._host_ready = ready

    def poll(self) -> None:
        self._grow_host()
        self._land(self.transfer.poll())

    def drain(self) -> None:
        self._land(self.transfer.drain())

    def _land(self, completions) -> None:
        for c in completions:
            kind, owner = self.jobs.pop(c.job_id)
            if kind == "restore" and owner is not None:
                owner.readers -= 1
                if owner.readers == 0 and owner in self.zombies:
                    self.zombies.remove(owner)
                    self._free_host(owner)
            if not c.ok:
                self.counters["transfer_failures"] += 1
                self.failed = f"{kind} transfer {c.job_id} failed: {c.error}"
                if kind == "demote" and owner is not None and owner.id in self.catalog.owners:
                    self._drop(owner)

    # ------------------------------------------------------------------ checks and stats
    def check_invariants(self) -> None:
        self.catalog.check_invariants()
        self.pool.check_invariants()
        refs = [0] * self.pool.num_pages
        held: set[int] = set()
        for o in self.catalog.owners.values():
            for p in o.pages:
                refs[p] += 1
                held.add(p)
        for lane in self.plans:
            for p in lane.pages:
                refs[p] += 1
        assert refs == self.refs, "page holders do not match the reference counts"
        for p, n in enumerate(refs):  # held by an owner: Cached; by lanes only: Active, or Cached
            state = self.pool.state(p)  # when the owner that held it left before the lane
            ok = state is PageState.FREE if n == 0 else (state is PageState.CACHED if p in held
                                                         else state in (PageState.ACTIVE, PageState.CACHED))
            assert ok, f"page {p}: {n} holders, state {state.name}"
        slots = [c.slot for o in self.catalog.owners.values() for c in o.checkpoints if c.slot is not None]
        slots += [c.slot for plan in self.plans.values() for c in plan.anchors]
        assert sorted(slots + self.free_slots) == list(range(self.C, self.C + self.config.device_state_slots)), \
            "device state slots lost or doubled"
        slabs = [s for o in [*self.catalog.owners.values(), *self.zombies] for s in
                 [*o.slabs, *(x for c in o.checkpoints for x in c.image_slabs)]]
        assert sorted(slabs + self.free_slabs) == list(range(self._host_ready)), "host slabs lost or doubled"
        assert self.kv_slabs_used <= self.kv_slabs and self.images_used <= self.host_images

    def leftovers(self) -> dict[str, int]:
        return {"active_pages": self.pool.num_active, "filling_pages": self.pool.num_filling, "lanes": len(self.plans),
                "lanes_out": self.C - len(self.free_active), "readers": sum(o.readers for o in self.catalog.owners.values()),
                "zombies": len(self.zombies), "transfers_pending": self.transfer.pending}

    def residency(self) -> Held:
        used_slots = self.config.device_state_slots - len(self.free_slots)
        host_used = self._host_ready - len(self.free_slabs)
        entries = sum(len(o.checkpoints) for o in self.catalog.owners.values())
        return Held(device_kv_bytes=self.pool.num_cached * self.storage.page_bytes,
                    device_state_bytes=used_slots * self.states.image_bytes,
                    host_bytes=host_used * self.host.slab_bytes, entries=entries)

    def stats(self, *, detailed: bool = False) -> LegacyCacheStats:
        out = LegacyCacheStats(
            mode=self.mode, catalog=self.catalog.counts(), pool=self.pool.counts(), pages=self.pool.num_pages,
            page_bytes=self.storage.page_bytes, image_bytes=self.states.image_bytes,
            lanes_free=len(self.free_active), device_state_slots=self.config.device_state_slots,
            device_state_slots_used=self.config.device_state_slots - len(self.free_slots),
            host_slabs=self.host.num_slabs, slab_bytes=self.host.slab_bytes, host_kv_slabs=self.kv_slabs,
            host_kv_slabs_used=self.kv_slabs_used, host_state_slots=self.host_images,
            host_state_slots_used=self.images_used, host_tier=self.host.progress(),
            transfers_pending=self.transfer.pending, residency=self.residency(), counters=dict(self.counters))
        if detailed:  # the checkpoints of the 16 most recently used owners, as the snapshot table's rows
            out.top_snapshots = [{"id": o.id, "frontier": c.frontier, "kind": c.kind.value,
                                     "residency": o.residency.value, "tail": "-", "hits": c.hits, "gdsf": None,
                                     "superseded": False}
                                    for o in sorted(self.catalog.owners.values(), key=lambda o: -o.last_used)[:16]
                                    for c in o.checkpoints]
        return out

