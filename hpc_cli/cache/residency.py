"""Residency: which copies exist, what pins them, the device LRU (spec §5.2, §9.1, §9.4).

:class:`ResidencyLedger` changes a node's or a snapshot's copies (device pages, device image,
host slabs) and keeps what follows from them true at every change: the pins (active refs,
restore pins, the pin mass that keeps a device-only subtree a transfer reads out of the LRU),
each entry's place in the device LRU (``backed`` + ``unbacked``, tail-first), the dead-KV set
(:class:`DeadKv`, §9.3 step 1) and the tally. Losing the last copy deletes the node, its
subtree and the snapshots anchored in it (§9.4); the device LRU's evictions are here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from hpc_cli.cache.ids import PageBundle
from hpc_cli.cache.lru import LruList
from hpc_cli.cache.records import Clock, Freed
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.stats import Counters, Tally
from hpc_cli.cache.tree import ABSENT, RESIDENT, BlockNode, BlockTree

if TYPE_CHECKING:
    from hpc_cli.cache.host import HostSlabPool
    from hpc_cli.cache.slots import SlotTable
    from hpc_cli.cache.supersession import Lineage


class DeadKv:
    """Dead KV (§9.3 step 1): host Resident, no snapshot below, no refs or pins; a node with no
    device copy qualifies only as a leaf (so the sweep goes leaves first). Oldest first."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: dict[BlockNode, None] = {}

    def update(self, node: BlockNode) -> None:
        if node.parent is None:
            return
        dead = (node.alive and node.host_state == RESIDENT and node.live_snapshots_below == 0
                and node.active_refs == 0 and node.restore_pins == 0
                and (node.device_state != ABSENT or node.n_children == 0))
        if dead:
            if node not in self.nodes:
                self.nodes[node] = None
        else:
            self.nodes.pop(node, None)


class ResidencyLedger:
    """Copies, pins, the device LRU and deletion of the index's nodes and snapshots."""

    def __init__(self, tree: BlockTree, host: HostSlabPool, slots: SlotTable, lineage: Lineage,
                 tally: Tally, counters: Counters, clock: Clock, num_pools: int) -> None:
        self.tree = tree
        self.host = host
        self.slots = slots
        self.lineage = lineage
        self.dead = lineage.dead
        self.tally = tally
        self.counters = counters
        self.clock = clock
        self.num_pools = num_pools
        self.lru_backed = LruList("device-lru-backed")
        self.lru_unbacked = LruList("device-lru-unbacked")
        self.awaiting_restore: dict[BlockNode, None] = {}  # staged, pages not yet given

    def check_bundle(self, pages: PageBundle | list[int]) -> None:
        assert len(pages) == self.num_pools, \
            f"a page bundle has one page per pool ({self.num_pools}), got {tuple(pages)}"

    # ------------------------------------------------------------------ pins
    def pin_node(self, node: BlockNode) -> None:
        """A sequence's path takes ``node`` (active_refs++): out of the LRU and the dead set."""
        if not node.pinned:
            self.tally.nodes_pinned += 1
        node.active_refs += 1
        if node.lru_list is not None:
            node.lru_list.remove(node)
        self.dead.nodes.pop(node, None)

    def node_pins(self, node: BlockNode, delta: int) -> None:
        """A transfer reading or writing ``node`` starts (+1) or lands (-1)."""
        was = node.pinned
        node.restore_pins += delta
        assert node.restore_pins >= 0, f"{node!r}: restore_pins below zero"
        self.tally.nodes_pinned += node.pinned - was
        self._self_pin(node)
        self.relink(node)
        self.dead.update(node)

    def snap_pins(self, s: Snapshot, delta: int) -> None:
        """A stage or a transfer pins (+1) or unpins (-1) ``s``, its image and tail."""
        before = s.restore_pins
        s.restore_pins += delta
        assert s.restore_pins >= 0, f"{s!r}: restore_pins below zero"
        if (before > 0) != (s.restore_pins > 0):
            s.anchor.pinned_snaps += 1 if delta > 0 else -1
            self._self_pin(s.anchor)
        self.relink_tail(s)

    def _self_pin(self, node: BlockNode) -> None:
        want = 1 if (node.restore_pins > 0 or node.pinned_snaps > 0) else 0
        if want == node.self_pin:
            return
        delta = want - node.self_pin
        node.self_pin = want
        n: BlockNode | None = node
        while n is not None:
            before = n.pin_mass
            n.pin_mass += delta
            self.relink(n)
            if (before > 0) == (n.pin_mass > 0):
                break
            n = n.parent

    def subtree_pinned(self, node: BlockNode) -> bool:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.active_refs or n.restore_pins or any(s.restore_pins for s in n.snapshots):
                return True
            stack.extend(n.iter_children())
        return False

    # ------------------------------------------------------------------ the device LRU (§9.1)
    def relink(self, node: BlockNode) -> None:
        """Put a node in the list its state calls for (kept in place when already there)."""
        if node.parent is None:
            return
        if node.alive and node.device_state == RESIDENT and node.active_refs == 0 and node.restore_pins == 0:
            if node.host_state == RESIDENT:
                target = self.lru_backed
            else:
                target = self.lru_unbacked if node.pin_mass == 0 else None
        else:
            target = None
        _move(node, target)

    def relink_tail(self, s: Snapshot) -> None:
        if s.alive and s.tail_device_state == RESIDENT and s.restore_pins == 0:
            target = self.lru_backed if s.tail_host_state == RESIDENT else self.lru_unbacked
        else:
            target = None
        _move(s, target)

    def evictable_pages(self) -> int:
        return len(self.lru_backed) + len(self.lru_unbacked)

    def evict_device(self, pages: int) -> Freed:
        """Free at least ``pages`` page bundles from the device LRU head, backed entries first.
        A backed entry loses its device copy; an unbacked one its last copy (§9.4)."""
        freed = Freed()
        if pages <= 0:
            return freed
        self.clock.epoch += 1
        while len(freed.pages) < pages:
            e = self.lru_backed.head()
            if e is not None:
                freed.pages.append(self._drop_device_entry(e))
                continue
            skipped = 0
            while True:
                e = self.lru_unbacked.head()
                if e is None or skipped >= len(self.lru_unbacked):
                    return freed
                if isinstance(e, BlockNode):
                    if self.subtree_pinned(e):
                        self.lru_unbacked.move_to_mru(e)  # a transfer still reads below it
                        skipped += 1
                        continue
                    self.delete_subtree(e, freed)
                else:
                    self.delete_snapshot(e, freed)
                self.counters.device_evictions_unbacked += 1
                break
        return freed

    def evict_backed(self, pages: int, keep: Iterable[BlockNode] = ()) -> Freed:
        """Free up to ``pages`` host-backed device copies, least recently used first, never a
        node in ``keep`` and never a last copy (a prefetch's room, spec §6.6)."""
        freed = Freed()
        keep = set(keep)
        self.clock.epoch += 1
        skipped = 0
        while len(freed.pages) < pages and skipped < len(self.lru_backed):
            e = self.lru_backed.head()
            if e in keep:
                self.lru_backed.move_to_mru(e)  # the head's own path stays (it is about to be hit)
                skipped += 1
                continue
            freed.pages.append(self._drop_device_entry(e))
        return freed

    def _drop_device_entry(self, e: BlockNode | Snapshot) -> PageBundle:
        """The backed LRU's head gives up its device pages (a node's, or a snapshot's tail)."""
        pages = self.drop_device_node(e) if isinstance(e, BlockNode) else self.drop_device_tail(e)
        self.counters.device_evictions_backed += 1
        return pages

    def touch(self, nodes: Iterable[BlockNode]) -> None:
        """A hit: unpinned device-resident nodes move to the MRU end, shallow first (so the
        deepest stays nearest the head among them)."""
        self.clock.tick += 1
        for node in reversed(list(nodes)):
            if node.lru_list is not None:
                node.lru_list.move_to_mru(node)

    # ------------------------------------------------------------------ dropping one copy
    def drop_copy(self, node: BlockNode, *, device: bool = False, host: bool = False) -> Freed:
        """Drop a node's device and/or host copy (an unpinned node only), e.g. after a failed
        transfer; a node left with no copy is deleted with its subtree (§9.4)."""
        assert node.alive and not node.is_root, f"drop_copy of {node!r}"
        assert not node.pinned, f"drop_copy of pinned {node!r}"
        freed = Freed()
        self.clock.epoch += 1
        has_dev = node.device_state == RESIDENT
        has_host = node.host_state == RESIDENT
        keep_dev = has_dev and not device
        keep_host = has_host and not host
        if not keep_dev and not keep_host:
            assert not self.subtree_pinned(node), f"drop_copy of {node!r}: something below it is pinned"
            self.delete_subtree(node, freed)
        elif device and has_dev:
            freed.pages.append(self.drop_device_node(node))
        elif host and has_host:
            self.drop_host_node(node, freed)
        return freed

    def drop_device_node(self, node: BlockNode) -> PageBundle:
        assert node.device_state == RESIDENT and node.host_state == RESIDENT and not node.pinned, \
            f"dropping the device copy of {node!r}"
        pages = node.device_pages
        assert pages is not None
        self.tally.count_node(node, -1)
        node.device_pages = None
        node.device_state = ABSENT
        self.tally.count_node(node, +1)
        self.relink(node)
        self.dead.update(node)
        return pages

    def drop_device_tail(self, s: Snapshot) -> PageBundle:
        assert s.tail_device_state == RESIDENT and s.tail_host_state == RESIDENT and s.restore_pins == 0
        pages = s.tail_pages
        assert pages is not None
        self.tally.count_snapshot(s, -1)
        s.tail_pages = None
        s.tail_device_state = ABSENT
        self.tally.count_snapshot(s, +1)
        self.relink_tail(s)
        return pages

    def drop_device_image(self, s: Snapshot) -> None:
        assert s.host_state == RESIDENT and s.restore_pins == 0, f"dropping the device image of {s!r}"
        self.slots.vacate(s.device_slot)
        self.tally.count_snapshot(s, -1)
        s.device_slot = -1
        s.device_state = ABSENT
        self.tally.count_snapshot(s, +1)
        self.clock.epoch += 1

    def drop_host_node(self, node: BlockNode, freed: Freed) -> None:
        assert node.host_state == RESIDENT and not node.pinned, f"dropping the host copy of {node!r}"
        if node.device_state == ABSENT:
            self.delete_subtree(node, freed)
            return
        self.host.free((node.host_slab,))
        freed.slabs.append(node.host_slab)
        self.tally.count_node(node, -1)
        node.host_slab = -1
        node.host_state = ABSENT
        self.tally.count_node(node, +1)
        self.dead.nodes.pop(node, None)
        self.relink(node)
        self.lineage.dirty_sole_owner(node)
        self.clock.epoch += 1

    def drop_host_snapshot(self, s: Snapshot, freed: Freed) -> None:
        """A victim complete on the device gives up only its host copy."""
        assert s.restore_pins == 0
        if s.host_state == RESIDENT:
            self.host.free(s.host_slabs)
            freed.slabs += s.host_slabs
            self.tally.count_snapshot(s, -1)
            s.host_slabs = ()
            s.host_state = ABSENT
            self.tally.count_snapshot(s, +1)
        if s.tail_host_state == RESIDENT:
            self.host.free((s.tail_host_slab,))
            freed.slabs.append(s.tail_host_slab)
            s.tail_host_slab = -1
            s.tail_host_state = ABSENT
            self.relink_tail(s)
        self.clock.epoch += 1

    # ------------------------------------------------------------------ losing the last copy (§9.4)
    def delete_subtree(self, node: BlockNode, freed: Freed) -> None:
        """Losing the last copy: delete the node, its subtree and every snapshot anchored in it."""
        order: list[BlockNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            assert not n.pinned, f"deleting pinned {n!r}"
            order.append(n)
            stack.extend(n.iter_children())
        for n in order:
            for s in list(n.snapshots):
                self.delete_snapshot(s, freed)
        parent = node.parent
        for n in reversed(order):  # children before parents
            self.tally.count_node(n, -1)
            if n.lru_list is not None:
                n.lru_list.remove(n)
            self.dead.nodes.pop(n, None)
            if n.device_state == RESIDENT:
                assert n.device_pages is not None
                freed.pages.append(n.device_pages)
            if n.host_state == RESIDENT:
                self.host.free((n.host_slab,))
                freed.slabs.append(n.host_slab)
            n.device_pages = None
            n.device_state = ABSENT
            n.host_slab = -1
            n.host_state = ABSENT
            self.tree.unlink(n)
            freed.nodes_deleted += 1
        self.counters.nodes_deleted += len(order)
        if parent is not None:
            self.dead.update(parent)
        self.clock.epoch += 1

    def delete_snapshot(self, s: Snapshot, freed: Freed) -> None:
        assert s.alive and s.restore_pins == 0, f"deleting pinned or dead {s!r}"
        self.tally.count_snapshot(s, -1)
        self.lineage.detach(s)
        if s.device_slot >= 0:
            self.slots.vacate(s.device_slot)
            freed.slots.append(s.device_slot)
            s.device_slot = -1
        s.device_state = ABSENT
        if s.host_state == RESIDENT:
            self.host.free(s.host_slabs)
            freed.slabs += s.host_slabs
        s.host_slabs = ()
        s.host_state = ABSENT
        if s.lru_list is not None:
            s.lru_list.remove(s)
        if s.tail_device_state == RESIDENT:
            assert s.tail_pages is not None
            freed.pages.append(s.tail_pages)
        s.tail_pages = None
        s.tail_device_state = ABSENT
        if s.tail_host_state == RESIDENT:
            self.host.free((s.tail_host_slab,))
            freed.slabs.append(s.tail_host_slab)
        s.tail_host_slab = -1
        s.tail_host_state = ABSENT
        s.alive = False
        freed.snapshots_deleted += 1
        self.counters.snapshots_deleted += 1
        self.clock.epoch += 1


def _move(entry, target: LruList | None) -> None:
    """Put a node or snapshot tail in ``target`` (None: no list), left in place if already there."""
    cur = entry.lru_list
    if cur is not target:
        if cur is not None:
            cur.remove(entry)
        if target is not None:
            target.append(entry)
