"""Device snapshot slots: the table and its grants (spec §9.2).

:class:`SlotTable` says who owns each device snapshot slot (a :class:`Snapshot`,
:data:`~hpc_cli.cache.records.STAGING` while a tap or endpoint copy is not yet published, or
nobody) and keeps the free stack. :class:`SlotGrants` gives a slot to a new snapshot in §9.2's
order: a free slot; a superseded owner's (oldest supersession first); the least valuable
device-only owner's, if the new snapshot is worth as much (GDSF's estimate); the least recently
hit host-backed owner's (it keeps its host copy). The sequence's lineage is superseded first
(§9.3), so its own previous tap can give its slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_cli.cache import gdsf
from hpc_cli.cache.ids import SnapshotSlot
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.records import STAGING, Clock, Freed, SequencePath, SlotGrant
from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.stats import Counters
from hpc_cli.cache.tree import ABSENT, RESIDENT

if TYPE_CHECKING:
    from hpc_cli.cache.residency import ResidencyLedger
    from hpc_cli.cache.supersession import Lineage


class SlotTable:
    """Owners of the device snapshot slots and the free stack (lowest slot on top)."""

    __slots__ = ("owner", "free")

    def __init__(self, n: int) -> None:
        self.owner: list[Snapshot | str | None] = [None] * n
        self.free: list[SnapshotSlot] = [SnapshotSlot(i) for i in range(n - 1, -1, -1)]

    def vacate(self, slot: SnapshotSlot) -> None:
        """The owner of ``slot`` lost its device image: the slot is free."""
        self.owner[slot] = None
        self.free.append(slot)

    def stage(self, slot: SnapshotSlot) -> None:
        """Reserve a free ``slot`` for a copy not yet published."""
        assert self.owner[slot] is None, f"slot {slot} still owned"
        self.free.remove(slot)
        self.owner[slot] = STAGING

    def release(self, slot: SnapshotSlot) -> None:
        """Give back a staged slot whose tap was dropped."""
        assert self.owner[slot] == STAGING, f"slot {slot} is not staged: {self.owner[slot]!r}"
        self.vacate(slot)


class SlotGrants:
    """§9.2's order of slot grants."""

    def __init__(self, table: SlotTable, residency: ResidencyLedger, lineage: Lineage,
                 priority: gdsf.Priority, clock: Clock, counters: Counters) -> None:
        self.table, self.residency, self.lineage = table, residency, lineage
        self.priority, self.clock, self.counters = priority, clock, counters

    def acquire(self, seq: SequencePath | None, kind: SnapshotKind, frontier: int,
                tail_len: int | None = None) -> SlotGrant | None:
        """A device snapshot slot for a tap or endpoint at ``frontier``, in §9.2's order; the
        sequence's lineage is superseded first (§9.3). None: the snapshot is skipped."""
        if seq is not None:
            self.lineage.supersede_lineage(seq, kind, frontier)
        if tail_len is None:
            tail_len = frontier % BLOCK_TOKENS
        table = self.table
        freed = Freed()
        if table.free:
            slot = table.free.pop()
            table.owner[slot] = STAGING
            return SlotGrant(slot, freed, 1)
        # 2. a superseded owner, oldest supersession first
        for s in self.lineage.superseded:
            if s.device_slot >= 0 and s.restore_pins == 0:
                slot = s.device_slot
                if s.host_state == RESIDENT:
                    self.residency.drop_device_image(s)
                else:
                    self.residency.delete_snapshot(s, freed)
                return self._grant(slot, freed, 2)
        # 3. the least valuable device-only owner, if the new snapshot is worth as much
        prev = 0
        if seq is not None:
            prev = max((x.frontier for x in (seq.last_tap, seq.source) if x is not None and x.alive
                        and x.frontier < frontier), default=0)
        h = self.priority
        est = gdsf.estimate_priority(self.clock.L, frontier, prev, tail_len > 0, h.cost,
                                     h.image_bytes, h.block_bytes)
        victim = None
        best = 0.0
        for o in table.owner:
            if isinstance(o, Snapshot) and o.host_state == ABSENT and o.restore_pins == 0:
                v = h(o)
                if victim is None or v < best:
                    victim, best = o, v
        if victim is not None and est >= best:
            slot = victim.device_slot
            self.clock.L = max(self.clock.L, best)
            self.residency.delete_snapshot(victim, freed)
            self.counters.slot_value_evictions += 1
            return self._grant(slot, freed, 3)
        # 4. the least recently hit host-backed owner loses its device copy
        victim = None
        for o in table.owner:
            if isinstance(o, Snapshot) and o.host_state == RESIDENT and o.restore_pins == 0:
                if victim is None or o.last_hit_tick < victim.last_hit_tick:
                    victim = o
        if victim is not None:
            slot = victim.device_slot
            self.residency.drop_device_image(victim)
            return self._grant(slot, freed, 4)
        self.counters.taps_skipped_no_slot += 1
        return None

    def _grant(self, slot: SnapshotSlot, freed: Freed, step: int) -> SlotGrant:
        self.table.stage(slot)
        if slot in freed.slots:
            freed.slots.remove(slot)  # handed straight to the new snapshot
        return SlotGrant(slot, freed, step)
