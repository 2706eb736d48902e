"""Counts and bytes of the index, by kind and residency, as an :class:`IndexStats` (for
metrics and the terminal view: the engine writes it as JSON at the HTTP edge), and the running
event counters.

Two kinds of numbers: the :class:`Tally` of gauges the index keeps up to date as its state
changes (:func:`summary`, O(1), the stepping path's and /metrics' view), and the walks that
only a client's request or a test pays for: :func:`recount` / :func:`stats` (every node,
snapshot and slab), :func:`snapshot_rows` (the terminal view's table), :func:`inflight_bytes`.

The stats types' two field markers are defined here, the lowest layer that makes such types
(:func:`hpc_cli.engine.stats_types.to_json` reads them): :data:`FLAT` and :data:`OPTIONAL`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from hpc_cli.cache.tree import ABSENT, FILLING

if TYPE_CHECKING:
    from hpc_cli.cache.index import PrefixIndex
    from hpc_cli.cache.records import RestoreBatch, WriteBatch
    from hpc_cli.cache.snapshot import Snapshot
    from hpc_cli.cache.tree import BlockNode


#: field metadata: the mapping's keys join the parent's in the JSON
FLAT = {"flat": True}
#: field metadata: the key is left out of the JSON while the value is None
OPTIONAL = {"optional": True}


@dataclass(slots=True)
class Counters:
    """Events since construction (monotonic)."""

    quotes: int = 0
    stages: int = 0
    reuse_tokens: int = 0
    restores: int = 0
    restored_bytes: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0
    commits: Counter = field(default_factory=Counter)
    published: Counter = field(default_factory=Counter)
    publish_duplicates: int = 0
    snapshot_hits: int = 0
    superseded: int = 0
    retained_again: int = 0
    image_writes_refused: int = 0
    block_writes_refused: int = 0
    writes_landed: int = 0
    device_evictions_backed: int = 0
    device_evictions_unbacked: int = 0
    dead_kv_reclaimed: int = 0
    host_superseded_evictions: int = 0
    host_gdsf_evictions: int = 0
    slot_value_evictions: int = 0
    taps_skipped_no_slot: int = 0
    nodes_deleted: int = 0
    snapshots_deleted: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["commits"] = dict(self.commits)
        d["published"] = dict(self.published)
        return d

    def copy(self) -> Counters:
        """The counts now, apart from the running ones (what a stats snapshot holds)."""
        return dataclasses.replace(self, commits=Counter(self.commits), published=Counter(self.published))


@dataclass(frozen=True, slots=True)
class NodeCounts:
    """The tree's block nodes: all of them, by residency, being filled, pinned."""

    total: int
    #: by residency (:data:`RESIDENCY`), the residencies with no node left out (as in the JSON)
    by_residency: dict[str, int] = field(metadata=FLAT)
    filling: dict[str, int]  # "device", "host": nodes with a copy being filled there, left out while 0
    pinned: int  # active_refs or restore_pins


@dataclass(frozen=True, slots=True)
class SnapshotCounts:
    """The snapshots: all of them, by kind and by residency of the image (kinds and residencies
    with none left out), with a tail, superseded."""

    total: int
    by_kind: dict[str, int]
    by_residency: dict[str, int]
    with_tail: int
    superseded: int


@dataclass(frozen=True, slots=True)
class DeviceCounts:
    """What the index holds on the device: cached block bundles, the LRU lengths, the snapshot
    slots and the bytes of both."""

    cached_page_bundles: int
    lru_backed: int
    lru_unbacked: int
    snapshot_slots: int
    snapshot_slots_used: int
    block_bytes_cached: int
    image_bytes_cached: int


@dataclass(frozen=True, slots=True)
class HostCounts:
    """The host slabs: all, ready, free, their size, slabs and bytes by use (``free``, ``node``,
    ``image``, ``tail``: uses with none left out) and the dead-KV nodes."""

    slabs: int
    ready_slabs: int
    free_slabs: int
    slab_bytes: int
    slabs_by_use: dict[str, int]
    bytes_by_use: dict[str, int]
    dead_kv_nodes: int


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """Restore and write-through batches open."""

    restores: int
    writes: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    """The index's counts (:func:`summary`, :func:`stats`); its JSON is ``cache.index`` of the
    engine's stats."""

    nodes: NodeCounts
    snapshots: SnapshotCounts
    device: DeviceCounts
    host: HostCounts
    gdsf_L: float
    epoch: int
    sequences: int
    transfers: TransferCounts
    counters: Counters  # a copy (:meth:`Counters.copy`): the index goes on counting in its own


#: residency names by ``2 * has_device + has_host`` (a live node or image always has a copy)
RESIDENCY = ("none", "host", "device", "both")


def _res(dev: bool, host: bool) -> str:
    return RESIDENCY[2 * dev + host]


@dataclass(slots=True)
class Tally:
    """Gauges of the index, kept up to date by :class:`~hpc_cli.cache.index.PrefixIndex` where
    the state they count changes (O(1) per change), so the stepping path never walks the tree,
    the snapshots or the slabs. ``check_invariants`` compares every field with :func:`recount`.

    Residency is by copy present (Resident or Filling), indexed like :data:`RESIDENCY`."""

    nodes: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    nodes_filling_device: int = 0
    nodes_filling_host: int = 0
    nodes_pinned: int = 0  # active_refs or restore_pins
    snapshots: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # by image residency
    snapshots_by_kind: Counter = field(default_factory=Counter)
    snapshots_with_tail: int = 0
    tail_page_bundles: int = 0  # snapshot tails holding a device page bundle
    restore_bytes: int = 0  # restores in flight (block bundles, images, tails)
    write_bytes: int = 0  # write-throughs in flight

    def count_node(self, n: BlockNode, sign: int) -> None:
        """Add (``sign`` +1) or take away (-1) one node's part."""
        dev, host = n.device_state, n.host_state
        self.nodes[2 * (dev != ABSENT) + (host != ABSENT)] += sign
        if dev == FILLING:
            self.nodes_filling_device += sign
        if host == FILLING:
            self.nodes_filling_host += sign
        if n.active_refs or n.restore_pins:
            self.nodes_pinned += sign

    def count_snapshot(self, s: Snapshot, sign: int) -> None:
        """Add or take away one snapshot's part."""
        self.snapshots[2 * (s.device_state != ABSENT) + (s.host_state != ABSENT)] += sign
        self.snapshots_by_kind[s.kind.value] += sign
        if s.tail_tokens:
            self.snapshots_with_tail += sign
        if s.tail_pages is not None:
            self.tail_page_bundles += sign

    def differences(self, other: Tally) -> list[str]:
        """The fields in which ``other`` differs, as ``name: mine != theirs``."""
        out = []
        for name in self.__slots__:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, Counter):  # kinds counted down to zero are absent
                a, b = ({k: v for k, v in c.items() if v} for c in (a, b))
            if a != b:
                out.append(f"{name}: {a} != {b}")
        return out


def recount(index: PrefixIndex) -> Tally:
    """The :class:`Tally` from a full walk of the tree, the snapshots and the in-flight batches
    (O(everything): for :func:`check_invariants` and :func:`stats`, never the stepping path)."""
    t = Tally()
    for n in index.tree.walk():
        t.count_node(n, +1)
    for s in index.snapshots.values():
        t.count_snapshot(s, +1)
    b = inflight_bytes(index)
    t.restore_bytes, t.write_bytes = b.restore_bytes, b.write_bytes
    return t


def summary(index: PrefixIndex) -> IndexStats:
    """The index's counts from its running :class:`Tally` and the pools' own counts: node and
    snapshot counts by residency and kind, host slabs and bytes by use, device pages cached, LRU
    and dead-KV lengths, slots, L, the in-flight batches and the event counters. O(1): what the
    engine publishes every few hundred milliseconds and /metrics exports."""
    return _document(index, index.tally, index.host.slabs_by_use())


def stats(index: PrefixIndex) -> IndexStats:
    """:func:`summary`'s counts with every count taken by a full walk (tests and debugging;
    the two agree whenever :func:`check_invariants` holds)."""
    return _document(index, recount(index), index.host.recount_by_use())


def _nonzero(pairs) -> dict:
    return {k: v for k, v in pairs if v}


def _document(index: PrefixIndex, t: Tally, slabs_by_use: dict[str, int]) -> IndexStats:
    host = index.host
    device_pages = t.nodes[2] + t.nodes[3] + t.tail_page_bundles
    slots = len(index.slot_owner)
    sb = host.slab_bytes
    return IndexStats(
        nodes=NodeCounts(total=index.tree.size, by_residency=_nonzero(zip(RESIDENCY, t.nodes)),
                         filling=_nonzero((("device", t.nodes_filling_device), ("host", t.nodes_filling_host))),
                         pinned=t.nodes_pinned),
        snapshots=SnapshotCounts(total=len(index.snapshots), by_kind=_nonzero(t.snapshots_by_kind.items()),
                                 by_residency=_nonzero(zip(RESIDENCY, t.snapshots)),
                                 with_tail=t.snapshots_with_tail, superseded=len(index.lineage.superseded)),
        device=DeviceCounts(cached_page_bundles=device_pages, lru_backed=len(index.lru_backed),
                            lru_unbacked=len(index.lru_unbacked), snapshot_slots=slots,
                            snapshot_slots_used=slots - len(index.slots.free),
                            block_bytes_cached=device_pages * index.block_bytes,
                            image_bytes_cached=(t.snapshots[2] + t.snapshots[3]) * index.image_bytes),
        host=HostCounts(slabs=host.num_slabs, ready_slabs=host.ready_slabs, free_slabs=host.free_slabs,
                        slab_bytes=sb, slabs_by_use=slabs_by_use,
                        bytes_by_use={k: v * sb for k, v in slabs_by_use.items()},
                        dead_kv_nodes=len(index.residency.dead.nodes)),
        gdsf_L=index.L, epoch=index.epoch, sequences=len(index.sequences),
        transfers=TransferCounts(restores=len(index.restores), writes=len(index.writes)),
        counters=index.counters.copy())


def snapshot_rows(index: PrefixIndex, limit: int = 16) -> list[dict]:
    """The ``limit`` snapshots of highest GDSF value (then most hits), one JSON-able row each:
    id, frontier, kind, residency of the image and of the tail, hits, GDSF value (``None``
    while stale), superseded. Read-only and bounded; for the terminal view."""
    import heapq

    snaps = list(index.snapshots.values())  # one copy; the walk below never touches the dict
    top = heapq.nlargest(max(0, limit), snaps, key=lambda s: (not s.superseded, s.gdsf_h, s.hits, s.frontier))
    rows = []
    for s in top:
        tail = "-" if not s.tail_tokens else _res(s.tail_device_state != ABSENT, s.tail_host_state != ABSENT)
        rows.append({"id": s.id, "frontier": s.frontier, "kind": s.kind.value,
                     "residency": _res(s.device_state != ABSENT, s.host_state != ABSENT),
                     "tail": tail, "hits": s.hits, "gdsf": None if s.dirty else round(s.gdsf_h, 6),
                     "superseded": s.superseded})
    return rows


def restore_batch_bytes(batch: RestoreBatch, block_bytes: int, image_bytes: int) -> int:
    """Bytes one restore batch moves: its block bundles, the image if restored, the tail."""
    st = batch.snapshot
    tail = st is not None and st.tail_pages is not None
    return (len(batch.blocks) + tail) * block_bytes + (image_bytes if batch.restore_image else 0)


def write_batch_bytes(batch: WriteBatch, block_bytes: int, image_bytes: int) -> int:
    """Bytes one write-through batch moves: block bundles, images (a write carries an image
    when it has image slabs) and tails."""
    n = len(batch.blocks) * block_bytes
    for t in batch.snapshots:
        n += (image_bytes if t.slabs else 0) + (block_bytes if t.tail_pages is not None else 0)
    return n


@dataclass(frozen=True, slots=True)
class InflightBytes:
    """Bytes of the copies in flight: :func:`inflight_bytes`, or the tally's running sums."""

    restore_bytes: int
    write_bytes: int


def inflight_bytes(index: PrefixIndex) -> InflightBytes:
    """Bytes of the restores and write-throughs in flight (block bundles, images, tails), summed
    over the open batches (the tally keeps the same sums as batches open and land)."""
    bb, ib = index.block_bytes, index.image_bytes
    restores = sum(restore_batch_bytes(b, bb, ib) for b in list(index.restores.values()))
    writes = sum(write_batch_bytes(b, bb, ib) for b in list(index.writes.values()))
    return InflightBytes(restore_bytes=restores, write_bytes=writes)
