"""Transfers the index asks for (spec §6.5, §6.6, §7.6-7.7).

:class:`Transfers` opens the batches the memory layer runs: a restore (host-only path blocks,
tail and image of an admission's source, §6.5), a prefetch (host-only blocks of a blocked
head's source, §6.6), write-through (a released sequence's device-only blocks, §7.7; a new
snapshot's image and tail, §7.4). What a batch reads or writes is Filling and pinned until the
memory layer reports it landed (:meth:`Transfers.land_restore`, :meth:`Transfers.land_write`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from hpc_cli.cache.eviction import HostEviction, alloc_host
from hpc_cli.cache.host import HostSlabPool, SlabUse
from hpc_cli.cache.ids import PageBundle
from hpc_cli.cache.records import (
    BlockTransfer,
    Freed,
    Quote,
    RestoreBatch,
    SnapshotTransfer,
    Staged,
    WriteBatch,
)
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.stats import Counters, Tally, restore_batch_bytes, write_batch_bytes
from hpc_cli.cache.tree import ABSENT, FILLING, RESIDENT, BlockNode

if TYPE_CHECKING:
    from hpc_cli.cache.gdsf import Priority
    from hpc_cli.cache.residency import ResidencyLedger
    from hpc_cli.cache.supersession import Lineage


class Transfers:
    """Restore and write batches in flight, by id."""

    def __init__(self, residency: ResidencyLedger, lineage: Lineage, eviction: HostEviction,
                 priority: Priority, image_slabs: int) -> None:
        self.residency, self.lineage, self.eviction = residency, lineage, eviction
        self.priority, self.image_slabs = priority, image_slabs
        self.block_bytes, self.image_bytes = priority.block_bytes, priority.image_bytes
        self.host: HostSlabPool = residency.host
        self.tally: Tally = residency.tally
        self.counters: Counters = residency.counters
        self.restores: dict[int, RestoreBatch] = {}
        self.writes: dict[int, WriteBatch] = {}
        self._next_batch = 1

    def _batch_id(self) -> int:
        bid = self._next_batch
        self._next_batch += 1
        return bid

    # ------------------------------------------------------------------ host to device (§6.5, §6.6)
    def restore(self, staged: Staged, pages: list[PageBundle],
                tail_pages: PageBundle | None) -> RestoreBatch:
        """An admission's restore: ``staged.restore_blocks`` adopt ``pages`` (path order), a
        host-only tail takes ``tail_pages``, a host-only image goes to the lane's own slot."""
        s = staged.quote.source
        batch = RestoreBatch(self._batch_id(), [], None, staged.restore_image)
        for node in staged.restore_blocks:
            self.residency.awaiting_restore.pop(node, None)
        self._fill_blocks(batch, staged.restore_blocks, pages, "restore")
        if s is not None and (staged.restore_tail or staged.restore_image):
            st = SnapshotTransfer(s, -1, s.host_slabs if staged.restore_image else ())
            if staged.restore_tail:
                assert tail_pages is not None, "a host-only tail needs a page bundle"
                self.residency.check_bundle(tail_pages)
                assert s.tail_device_state == ABSENT and s.tail_host_state == RESIDENT, \
                    f"tail restore of {s!r}: needs a host-only tail"
                self.tally.count_snapshot(s, -1)
                s.tail_pages = tuple(tail_pages)
                s.tail_device_state = FILLING
                self.tally.count_snapshot(s, +1)
                st.tail_pages = s.tail_pages
                st.tail_slab = s.tail_host_slab
            self.residency.snap_pins(s, +1)
            batch.snapshot = st
        self._open_restore(batch)
        self.counters.restores += 1
        self.counters.restored_bytes += (len(batch.blocks) * self.block_bytes
                                         + (self.image_bytes if staged.restore_image else 0)
                                         + (self.block_bytes if staged.restore_tail else 0))
        return batch

    def prefetch_candidates(self, quote: Quote, limit: int = 256) -> list[BlockNode]:
        """Host-only path blocks of the source admission would choose for a blocked head (the
        cheapest candidate, whether or not it fits now), at most ``limit``, shallowest first."""
        best = min(quote.candidates, key=lambda sc: sc[1])[0] if quote.candidates else None
        if best is None or not best.alive:
            return []
        depth = best.anchor.depth + 1
        path = quote.match.path[:depth]
        return [n for n in path if n.device_state == ABSENT and n.host_state == RESIDENT
                and n.alive][:limit]

    def prefetch(self, nodes: list[BlockNode], pages: Iterable[PageBundle]) -> RestoreBatch | None:
        """Copy host-only ``nodes`` into ``pages`` (one bundle each): they are Filling and pinned
        until :meth:`land_restore`, then ordinary cached blocks at the MRU end of the LRU."""
        pages = list(pages)
        assert len(pages) == len(nodes), f"{len(nodes)} prefetched blocks need pages, got {len(pages)}"
        if not nodes:
            return None
        self.residency.clock.epoch += 1
        batch = RestoreBatch(self._batch_id(), [], None, False)
        self._fill_blocks(batch, nodes, pages, "prefetch")
        self._open_restore(batch)
        self.counters.prefetches += 1
        self.counters.prefetched_blocks += len(nodes)
        return batch

    def _fill_blocks(self, batch: RestoreBatch, nodes: list[BlockNode], pages: list[PageBundle],
                     what: str) -> None:
        """Host-only ``nodes`` take ``pages`` and become device Filling, pinned by ``batch``."""
        residency, tally = self.residency, self.tally
        for node, pg in zip(nodes, pages):
            residency.check_bundle(pg)
            assert node.alive and node.device_state == ABSENT and node.host_state == RESIDENT, \
                f"{what} of {node!r}: needs a host-only node"
            tally.count_node(node, -1)
            node.device_pages = tuple(pg)
            node.device_state = FILLING
            tally.count_node(node, +1)
            residency.node_pins(node, +1)
            batch.blocks.append(BlockTransfer(node, node.device_pages, node.host_slab))

    def land_restore(self, batch: RestoreBatch | None) -> None:
        """The restore batch's last event completed: its destinations are Resident and its
        pins drop (spec §6.5, poll)."""
        if batch is None:
            return
        _close(batch, "restore", self.restores)
        self.tally.restore_bytes -= batch.nbytes
        for bt in batch.blocks:
            node = bt.node
            assert node.device_state == FILLING, f"landing {node!r}: not Filling"
            self.tally.count_node(node, -1)
            node.device_state = RESIDENT
            self.tally.count_node(node, +1)
            self.residency.node_pins(node, -1)
        st = batch.snapshot
        if st is not None:
            s = st.snapshot
            if st.tail_pages is not None:
                s.tail_device_state = RESIDENT
            self.residency.snap_pins(s, -1)

    # ------------------------------------------------------------------ device to host (§7.4, §7.7)
    def write_blocks(self, nodes: list[BlockNode], freed: Freed) -> WriteBatch | None:
        """Write-through of the device-only nodes among ``nodes`` (path order), one batch; it
        stops at the first block the host cannot make room for."""
        blocks = []
        for node in nodes:
            if node.host_state == ABSENT and node.device_state == RESIDENT and node.alive:
                slabs = alloc_host(self.host, 1, SlabUse.NODE, node, self.eviction, freed)
                if slabs is None:
                    self.counters.block_writes_refused += 1
                    break
                self.tally.count_node(node, -1)
                node.host_slab = slabs[0]
                node.host_state = FILLING
                self.tally.count_node(node, +1)
                self.residency.node_pins(node, +1)
                self.lineage.dirty_sole_owner(node)
                blocks.append(BlockTransfer(node, node.device_pages, node.host_slab))
        if not blocks:
            return None
        write = WriteBatch(self._batch_id(), blocks, [])
        self._open_write(write)
        return write

    def write_snapshot(self, s: Snapshot, freed: Freed) -> WriteBatch | None:
        """Write-through of a new snapshot's image (and tail), if the host makes room for it
        without evicting anything worth more (GDSF)."""
        k = self.image_slabs + (1 if s.tail_tokens else 0)
        h_new = self.priority(s)
        self.residency.snap_pins(s, +1)  # keep s (and its tail) out of the victims while making room
        slabs = alloc_host(self.host, k, SlabUse.IMAGE, s, self.eviction, freed, bound=h_new)
        self.residency.snap_pins(s, -1)
        if slabs is None:
            self.counters.image_writes_refused += 1
            return None
        st = SnapshotTransfer(s, s.device_slot, tuple(slabs[:self.image_slabs]))
        self.tally.count_snapshot(s, -1)
        s.host_slabs = st.slabs
        s.host_state = FILLING
        self.tally.count_snapshot(s, +1)
        if s.tail_tokens:
            tail_slab = slabs[-1]
            self.host.set_use(tail_slab, SlabUse.TAIL)
            s.tail_host_slab = tail_slab
            s.tail_host_state = FILLING
            st.tail_pages = s.tail_pages
            st.tail_slab = tail_slab
        self.residency.snap_pins(s, +1)
        batch = WriteBatch(self._batch_id(), [], [st])
        self._open_write(batch)
        return batch

    def land_write(self, batch: WriteBatch | None) -> None:
        """Write-through completed: host copies become Resident and the sources unpin. Blocks
        join the backed LRU deepest first (tail-first order, §9.1)."""
        if batch is None:
            return
        _close(batch, "write", self.writes)
        self.tally.write_bytes -= batch.nbytes
        for bt in sorted(batch.blocks, key=lambda b: -b.node.depth):
            node = bt.node
            assert node.host_state == FILLING, f"landing write of {node!r}: not Filling"
            self.tally.count_node(node, -1)
            node.host_state = RESIDENT
            self.tally.count_node(node, +1)
            self.residency.node_pins(node, -1)
            self.lineage.dirty_sole_owner(node)
        for st in batch.snapshots:
            s = st.snapshot
            s.host_state = RESIDENT
            if s.tail_tokens:
                s.tail_host_state = RESIDENT
            self.residency.snap_pins(s, -1)
        self.counters.writes_landed += 1

    def _open_restore(self, batch: RestoreBatch) -> None:
        batch.nbytes = restore_batch_bytes(batch, self.block_bytes, self.image_bytes)
        self.restores[batch.id] = batch
        self.tally.restore_bytes += batch.nbytes

    def _open_write(self, batch: WriteBatch) -> None:
        batch.nbytes = write_batch_bytes(batch, self.block_bytes, self.image_bytes)
        self.writes[batch.id] = batch
        self.tally.write_bytes += batch.nbytes


def _close(batch: RestoreBatch | WriteBatch, kind: str, open_batches: dict) -> None:
    """The memory layer reported ``batch`` landed: it leaves the open batches (once only)."""
    assert not batch.landed, f"{kind} batch {batch.id} landed twice"
    batch.landed = True
    del open_batches[batch.id]
