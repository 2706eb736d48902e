"""Adoption: entries rebuilt host-only from bytes already in host slabs (spec §5.5).

The cache file's loader (:mod:`hpc_cli.cache.cachefile.plan`) and the shared tier
(``hpc_cli.engine.shared``) copy a block's or a snapshot's bytes into host slabs first, then
:class:`Adoption` makes them entries of the index: a host-only node under its parent, a
host-only retained snapshot on its anchor. Parents come first; adopting evicts nothing
(:meth:`Adoption.reserve_host_slabs` makes the room beforehand, §9.3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from hpc_cli.cache.eviction import HostEviction, alloc_host
from hpc_cli.cache.host import HostSlabPool, SlabUse
from hpc_cli.cache.ids import SlabId
from hpc_cli.cache.keys import lookup_hash
from hpc_cli.cache.records import ADOPTING, Clock, Freed
from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.stats import Tally
from hpc_cli.cache.tree import RESIDENT, BlockNode, BlockTree

if TYPE_CHECKING:
    from hpc_cli.cache.residency import ResidencyLedger
    from hpc_cli.cache.supersession import Lineage


class Adoption:
    """Adopts host-only entries; the nodes, slabs and counts are the residency ledger's."""

    def __init__(self, residency: ResidencyLedger, lineage: Lineage, eviction: HostEviction,
                 image_slabs: int) -> None:
        self.residency = residency
        self.lineage = lineage
        self.eviction = eviction
        self.image_slabs = image_slabs
        self.tree: BlockTree = residency.tree
        self.host: HostSlabPool = residency.host
        self.tally: Tally = residency.tally
        self.clock: Clock = residency.clock

    def reserve_host_slabs(self, k: int, keep: Iterable[BlockNode] = ()) -> tuple[list[SlabId] | None, Freed]:
        """Take ``k`` host slabs for entries about to be adopted (:meth:`adopt_host_node`,
        :meth:`adopt_host_snapshot`; the shared tier's fetches), making room by host eviction
        (§9.3) while the nodes of ``keep`` (the path they go under) are pinned. Returns the slabs,
        or None when the tier cannot make room, and what the eviction freed."""
        freed = Freed()
        keep = list(keep)
        for node in keep:
            self.residency.node_pins(node, +1)
        try:
            slabs = alloc_host(self.host, k, SlabUse.NODE, ADOPTING, self.eviction, freed)
        finally:
            for node in keep:
                self.residency.node_pins(node, -1)
        return slabs, freed

    def release_host_slabs(self, slabs: Iterable[SlabId]) -> None:
        """Give back slabs :meth:`reserve_host_slabs` took that no entry adopted (a fetch whose
        path changed meanwhile, or one abandoned)."""
        slabs = list(slabs)
        for s in slabs:
            assert self.host.owner_of(s) == ADOPTING, f"host slab {s} is not reserved for adoption: {self.host.owner_of(s)!r}"
        self.host.free(slabs)

    def adopt_host_node(self, parent: BlockNode, tokens: bytes, extra: int, slab: SlabId, *,
                        h: int | None = None, media: tuple = ()) -> BlockNode:
        """Rebuild a block from a cache file: a new host-only child of ``parent`` whose bytes are
        already in host slab ``slab`` (taken from the host pool by the loader; it becomes the
        node's). Parents come first; nothing is evicted."""
        assert parent.alive, f"adopt below a deleted node {parent!r}"
        if h is None:
            h = lookup_hash(parent.hash, tokens, extra)
        assert self.tree.child(parent, h, tokens, extra) is None, "adopt of an existing block key"
        node = self.tree.insert(parent, h, tokens, extra)
        node.media = tuple(media)
        self._reown((slab,), SlabUse.NODE, node)
        node.host_slab = slab
        node.host_state = RESIDENT
        self.tally.count_node(node, +1)
        self.residency.dead.update(node)
        self.residency.dead.update(parent)
        self.clock.epoch += 1
        return node

    def adopt_host_snapshot(self, anchor: BlockNode, frontier: int, kind: SnapshotKind, *,
                            tail_tokens: bytes = b"", hits: int = 0, image_slabs: tuple[SlabId, ...],
                            tail_slab: SlabId = SlabId(-1), tail_extra: int = 0) -> Snapshot:
        """Rebuild a retained snapshot from a cache file, host-only: its image (and tail) bytes are
        already in ``image_slabs`` (and ``tail_slab``), taken from the host pool by the loader."""
        assert anchor.alive, f"adopt on a deleted anchor {anchor!r}"
        assert frontier == anchor.end + len(tail_tokens) // 4, f"frontier {frontier} vs anchor {anchor!r}"
        assert len(image_slabs) == self.image_slabs, f"an image takes {self.image_slabs} slabs"
        assert (tail_slab >= 0) == bool(tail_tokens), "a tail slab iff the snapshot has a tail"
        assert all(t.tail_tokens != tail_tokens or t.tail_extra != tail_extra for t in anchor.snapshots), \
            "adopt of a duplicate snapshot"
        clock = self.clock
        clock.tick += 1
        s = Snapshot(self.lineage.mint_id(), anchor, frontier, kind, tail_tokens, tail_extra, hits=hits,
                     last_hit_tick=clock.tick, l_base=clock.L)
        self._reown(tuple(image_slabs), SlabUse.IMAGE, s)
        s.host_slabs = tuple(image_slabs)
        s.host_state = RESIDENT
        if tail_tokens:
            self._reown((tail_slab,), SlabUse.TAIL, s)
            s.tail_host_slab = tail_slab
            s.tail_host_state = RESIDENT
        self.tally.count_snapshot(s, +1)
        self.lineage.attach(s)
        clock.epoch += 1
        return s

    def _reown(self, slabs: tuple[SlabId, ...], use: SlabUse, owner: object) -> None:
        """Hand slabs the loader took from the pool to their entry (free then re-take: the free
        stack returns exactly these ids)."""
        pool = self.host
        pool.free(tuple(reversed(slabs)))
        got = pool.alloc(len(slabs), use, owner)
        assert got is not None and tuple(got) == tuple(slabs), f"reown of slabs {slabs} got {got}"
