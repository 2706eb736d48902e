"""The index's records: what its verbs take and return (spec §6.1-6.5, §7.4-7.7, §9.2).

Nodes and snapshots are :mod:`hpc_cli.cache.tree` and :mod:`hpc_cli.cache.snapshot`; this
module holds the records that cross the seam to the engine and the memory layer: what a call
freed (:class:`Freed`), the transfer batches the memory layer runs and reports back
(:class:`RestoreBatch`, :class:`WriteBatch`), admission's :class:`Quote` and :class:`Staged`,
a sequence's :class:`SequencePath`, and the :class:`Clock` every room of the index advances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hpc_cli.cache.host import round_slab
from hpc_cli.cache.ids import PageBundle, SlabId, SnapshotSlot
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.tree import BlockNode, MatchResult


class StaleQuote(Exception):
    """The cache changed (epoch moved) between quote and stage: quote again."""


class Readiness(Enum):
    READY = "ready"
    TEMPORARILY_BLOCKED = "temporarily_blocked"  # active entitlements hold the pages
    PERMANENTLY_INFEASIBLE = "permanently_infeasible"  # not even an empty cache would fit it


class CommitOutcome(Enum):
    """Block commit (spec §7.6)."""

    DUPLICATE = "duplicate"  # the node has a device copy: the sequence's page stays private
    ADOPTED = "adopted"  # the node was host-only: it adopts the sequence's page
    INSERTED = "inserted"  # a new node owns the sequence's page


#: A device snapshot slot reserved for a tap or endpoint copy that is not yet published.
STAGING = "staging"
#: The owner of host slabs reserved for entries whose bytes are still being copied in (the shared
#: tier's hits: copied on its own thread, adopted or released by the worker afterwards).
ADOPTING = "adopting"


@dataclass(slots=True, frozen=True)
class CacheGeometry:
    """Sizes the index accounts with. ``block_bytes`` is one block bundle's host record (all
    pools); ``host_bytes == 0`` disables the host tier; ``num_pools`` device pools per node
    (Main, plus a backend pool for MTP or DFlash)."""

    block_bytes: int
    image_bytes: int
    device_snapshot_slots: int
    host_bytes: int = 0
    num_pools: int = 1
    slab_bytes: int = 0  # 0: block_bytes rounded up to 4 KiB
    chunk_bytes: int = 4 << 30

    @property
    def slab(self) -> int:
        return self.slab_bytes or round_slab(self.block_bytes)


@dataclass(slots=True)
class Clock:
    """What every room of the index advances: ``epoch`` moves at each change a quote depends on
    (a stale quote is refused), ``tick`` orders hits and supersessions, ``L`` is GDSF's
    inflation value (spec §9.3)."""

    epoch: int = 0
    tick: int = 0
    L: float = 0.0


@dataclass(slots=True)
class Freed:
    """What an eviction or deletion released; the memory layer returns these to its pools.
    ``pages`` are page bundles (one page id per device pool); host slabs are already back on
    the index's free stack and listed for information."""

    pages: list[PageBundle] = field(default_factory=list)
    slots: list[SnapshotSlot] = field(default_factory=list)
    slabs: list[SlabId] = field(default_factory=list)
    nodes_deleted: int = 0
    snapshots_deleted: int = 0

    def extend(self, other: Freed) -> None:
        self.pages += other.pages
        self.slots += other.slots
        self.slabs += other.slabs
        self.nodes_deleted += other.nodes_deleted
        self.snapshots_deleted += other.snapshots_deleted


@dataclass(slots=True, eq=False)
class SequencePath:
    """A cache-enabled sequence's view of the tree: the nodes it pins (block order), the private
    pages of its Duplicate commits, and its lineage for supersession (§9.3)."""

    id: int
    nodes: list[BlockNode]
    source: Snapshot | None = None  # the snapshot it resumed from
    resumed_from_endpoint: bool = False
    to_supersede: Snapshot | None = None  # the resumed-from snapshot, until the lineage moves on
    last_tap: Snapshot | None = None  # the previous tap of this prompt
    duplicate_pages: list[PageBundle] = field(default_factory=list)
    stage_pin: Snapshot | None = None  # the source, pinned from stage to activate
    released: bool = False


@dataclass(slots=True)
class Quote:
    """An admission quote (spec §6.1-6.3), exact at ``epoch``."""

    readiness: Readiness
    match: MatchResult = field(repr=False)
    source: Snapshot | None  # None: prefill from the root
    reuse_tokens: int  # F_s, reported as cached_tokens
    cached_prefix_tokens: int  # longest cached block prefix, reusable or not
    path: list[BlockNode]  # nodes up to the source's anchor
    restore_blocks: list[BlockNode]  # host-only path nodes to restore
    restore_tail: bool
    restore_image: bool
    restore_bytes: int
    need_pages: int
    available_pages: int
    cost_seconds: float
    epoch: int
    candidates: list[tuple[Snapshot | None, float]]  # (source, cost) considered, root is None

    @property
    def ready(self) -> bool:
        return self.readiness is Readiness.READY


@dataclass(slots=True)
class Staged:
    seq: SequencePath
    quote: Quote
    freed: Freed  # device LRU evictions to make room (§6.4 step 2)
    restore_blocks: list[BlockNode]
    restore_tail: bool
    restore_image: bool
    short_pages: int = 0  # pages the LRU could not provide (0 when the quote was exact)


@dataclass(slots=True)
class BlockTransfer:
    node: BlockNode
    pages: PageBundle
    slab: SlabId


@dataclass(slots=True)
class SnapshotTransfer:
    snapshot: Snapshot
    slot: SnapshotSlot  # write: source device slot; restore: -1 (the lane's slot is the destination)
    slabs: tuple[SlabId, ...]  # image slabs, in image byte order
    tail_pages: PageBundle | None = None
    tail_slab: SlabId = SlabId(-1)


@dataclass(slots=True, eq=False)
class RestoreBatch:
    """Host-to-device copies of one admission (spec §6.5): host-only blocks into new cache
    pages, a host-only tail into a cache-owned page, a host-only image into the lane's slot."""

    id: int
    blocks: list[BlockTransfer]
    snapshot: SnapshotTransfer | None
    restore_image: bool
    landed: bool = False
    nbytes: int = 0  # what it moves, set when it opens (the tally's in-flight bytes)


@dataclass(slots=True, eq=False)
class WriteBatch:
    """Device-to-host write-through (spec §7.6, §7.7): block bundles and snapshot images/tails."""

    id: int
    blocks: list[BlockTransfer]
    snapshots: list[SnapshotTransfer]
    landed: bool = False
    nbytes: int = 0  # what it moves, set when it opens (the tally's in-flight bytes)

    def __bool__(self) -> bool:
        return bool(self.blocks or self.snapshots)


@dataclass(slots=True)
class Release:
    free_pages: list[PageBundle]  # Duplicate pages of the sequence (private, freed now)
    write: WriteBatch | None
    freed: Freed = field(default_factory=Freed)  # what making host room for the write displaced


@dataclass(slots=True)
class SlotGrant:
    slot: SnapshotSlot
    freed: Freed
    step: int  # which §9.2 rule gave it: 1 free, 2 superseded, 3 device-only, 4 host-backed


@dataclass(slots=True)
class PublishResult:
    snapshot: Snapshot
    duplicate: bool
    write: WriteBatch | None
    freed: Freed  # a duplicate's slot and tail pages, or what the host write displaced
