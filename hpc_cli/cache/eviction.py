"""Host eviction (spec §9.3): one victim at a time, as a strategy.

Host slabs are taken by write-through (a block, a snapshot's image and tail) and by adoption
(the cache file, the shared tier). When the free stack is short, :func:`alloc_host` asks the
index's :class:`HostEviction` strategy for one eviction at a time until the slabs are free or
the strategy has nothing left to give. :class:`SpecHostEviction` is §9.3's order: dead KV,
leaves first; then the oldest superseded snapshot, entirely; then the retained snapshot of
least GDSF priority H (:mod:`hpc_cli.cache.gdsf`), raising L to its H. A snapshot complete on
the device gives up only its host copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from hpc_cli.cache import gdsf
from hpc_cli.cache.host import HostSlabPool, SlabUse
from hpc_cli.cache.ids import SlabId
from hpc_cli.cache.records import Clock, Freed
from hpc_cli.cache.stats import Counters

if TYPE_CHECKING:
    from hpc_cli.cache.residency import ResidencyLedger
    from hpc_cli.cache.supersession import Lineage


class HostEviction(Protocol):
    def evict_one(self, freed: Freed, bound: float | None) -> bool:
        """Evict one host entry, adding what it released to ``freed``. False when nothing can
        go: nothing is evictable, or (``bound`` not None) the next victim is worth more than
        ``bound`` (GDSF never inserts what it would evict next)."""
        ...


class SpecHostEviction:
    """§9.3: dead KV, then superseded snapshots, then minimum H."""

    def __init__(self, residency: ResidencyLedger, lineage: Lineage, priority: gdsf.Priority,
                 clock: Clock, counters: Counters) -> None:
        self.residency = residency
        self.lineage = lineage
        self.priority = priority
        self.clock = clock
        self.counters = counters

    def evict_one(self, freed: Freed, bound: float | None) -> bool:
        dead = self.residency.dead.nodes
        if dead:  # 1. dead KV, leaves first
            self.residency.drop_host_node(next(iter(dead)), freed)
            self.counters.dead_kv_reclaimed += 1
            return True
        victim = next((s for s in self.lineage.superseded if s.restore_pins == 0), None)
        if victim is not None:  # 2. the oldest superseded snapshot, entirely
            self.residency.delete_snapshot(victim, freed)
            self.counters.host_superseded_evictions += 1
            return True
        victim, hv = gdsf.min_priority(self.lineage.snapshots.values(), self.priority)  # 3. minimum H
        if victim is None:
            return False
        if bound is not None and hv > bound:
            return False  # GDSF never inserts what it would evict next
        self.clock.L = max(self.clock.L, hv)
        self.counters.host_gdsf_evictions += 1
        if victim.device_complete:
            self.residency.drop_host_snapshot(victim, freed)
        else:
            self.residency.delete_snapshot(victim, freed)
        return True


def alloc_host(pool: HostSlabPool, k: int, use: SlabUse, owner: object, eviction: HostEviction,
               freed: Freed, bound: float | None = None) -> list[SlabId] | None:
    """``k`` host slabs for ``owner``, evicting as ``eviction`` says until they are free; None
    when the tier cannot make room."""
    if k > pool.ready_slabs:  # more than the tier holds now: evicting would not make room
        return None
    while pool.free_slabs < k:
        if not eviction.evict_one(freed, bound):
            return None
    return pool.alloc(k, use, owner)
