"""PrefixIndex: the hybrid prefix cache's model-agnostic index (spec §5, §6.1-6.4, §7.4-7.7, §9).

The index records page ids, slab ids and snapshot slot ids; it never touches memory. Every
call that frees something returns what to free (:class:`Freed`) and every transfer it asks for
is a batch (:class:`RestoreBatch`, :class:`WriteBatch`) whose copies the memory layer runs and
then reports with :meth:`PrefixIndex.land_restore` / :meth:`PrefixIndex.land_write`. One worker
thread is the only caller (spec §10.9).

The engine's flow, in the spec's words::

    q = index.quote(prompt, entitlement_pages=E, free_pages=f, total_pages=M)   # §6.1-6.3
    st = index.stage(q, free_pages=f)           # pin path + source, evict LRU (st.freed), §6.4
    rb = index.begin_restore(st, block_pages, tail_pages)   # host-only blocks/tail/image, §6.5
    seq = index.activate(st)                    # the lane owns the path pins
    index.commit_block(seq, tokens, pages)      # each time every pool crosses a block end, §7.6
    g = index.acquire_snapshot_slot(seq, kind, frontier)    # §9.2 (supersedes the lineage, §9.3)
    pr = index.publish(seq, kind, frontier, slot=g.slot, ...)   # §7.4 / §7.7
    rel = index.release(seq)                    # §7.7: write-through, refs--, LRU tail-first
    index.land_write(rel.write); index.land_write(pr.write); index.land_restore(rb)
    index.evict_device(pages)                   # §9.1, active growth (§9.5)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from hpc_cli.cache import gdsf
from hpc_cli.cache.cost import GENERIC, CacheCostModel
from hpc_cli.cache.host import HostSlabPool, SlabUse, image_slabs, round_slab
from hpc_cli.cache.keys import BLOCK_TOKENS, PreparedPrompt, lookup_hash
from hpc_cli.cache.lru import LruList
from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.stats import Counters, Tally, restore_batch_bytes, write_batch_bytes
from hpc_cli.cache.tree import ABSENT, FILLING, RESIDENT, BlockNode, BlockTree, MatchResult
from hpc_cli.errors import CapacityError


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
class Freed:
    """What an eviction or deletion released; the memory layer returns these to its pools.
    ``pages`` are page bundles (one page id per device pool); host slabs are already back on
    the index's free stack and listed for information."""

    pages: list[tuple[int, ...]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    slabs: list[int] = field(default_factory=list)
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
    duplicate_pages: list[tuple[int, ...]] = field(default_factory=list)
    stage_pin: Snapshot | None = None  # the source, pinned from stage to activate
    released: bool = False

    @property
    def committed_tokens(self) -> int:
        return BLOCK_TOKENS * len(self.nodes)


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
    pages: tuple[int, ...]
    slab: int


@dataclass(slots=True)
class SnapshotTransfer:
    snapshot: Snapshot
    slot: int  # write: source device slot; restore: -1 (the lane's slot is the destination)
    slabs: tuple[int, ...]  # image slabs, in image byte order
    tail_pages: tuple[int, ...] | None = None
    tail_slab: int = -1


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
    free_pages: list[tuple[int, ...]]  # Duplicate pages of the sequence (private, freed now)
    write: WriteBatch | None
    freed: Freed = field(default_factory=Freed)  # what making host room for the write displaced


@dataclass(slots=True)
class SlotGrant:
    slot: int
    freed: Freed
    step: int  # which §9.2 rule gave it: 1 free, 2 superseded, 3 device-only, 4 host-backed


@dataclass(slots=True)
class PublishResult:
    snapshot: Snapshot
    duplicate: bool
    write: WriteBatch | None
    freed: Freed  # a duplicate's slot and tail pages, or what the host write displaced


class PrefixIndex:
    """The block tree, snapshots, device LRU, snapshot slots and host slab accounting."""

    def __init__(self, geometry: CacheGeometry, cost: CacheCostModel = GENERIC, *,
                 host_ready_slabs: int | None = None) -> None:
        """``host_ready_slabs``: how many host slabs exist now when the memory layer pins the
        tier in the background (None: all); :meth:`grow_host` adds the rest as they are ready."""
        if geometry.device_snapshot_slots < 0:
            raise CapacityError("device_snapshot_slots must not be negative")
        if geometry.num_pools < 1:
            raise CapacityError("at least one device pool is needed")
        self.geometry = geometry
        self.cost = cost
        self.block_bytes = geometry.block_bytes
        self.image_bytes = geometry.image_bytes
        self.tree = BlockTree()
        self.tree.root.hash = _root_hash()
        self.host = HostSlabPool(geometry.host_bytes, geometry.slab, geometry.image_bytes,
                                 chunk_bytes=geometry.chunk_bytes, ready_slabs=host_ready_slabs)
        self.image_slabs = image_slabs(geometry.image_bytes, geometry.slab)
        self.lru_backed = LruList("device-lru-backed")
        self.lru_unbacked = LruList("device-lru-unbacked")
        self.slot_owner: list[Snapshot | str | None] = [None] * geometry.device_snapshot_slots
        self._free_slots: list[int] = list(range(geometry.device_snapshot_slots - 1, -1, -1))
        self.snapshots: dict[int, Snapshot] = {}
        self._top: dict[Snapshot, None] = {}  # snapshots with no snapshot above them
        self._superseded: dict[Snapshot, None] = {}  # in supersession order
        self._dead: dict[BlockNode, None] = {}  # dead KV on the host (§9.3 step 1)
        self._awaiting_restore: dict[BlockNode, None] = {}  # staged, pages not yet given
        self.sequences: dict[int, SequencePath] = {}
        self.restores: dict[int, RestoreBatch] = {}
        self.writes: dict[int, WriteBatch] = {}
        self.L = 0.0
        self.epoch = 0
        self.tick = 0
        self._next_snapshot = 1
        self._next_seq = 1
        self._next_batch = 1
        self.counters = Counters()
        #: gauges kept up to date at every change of state (stats.summary reads them, O(1));
        #: check_invariants compares them with a full recount
        self.tally = Tally()

    # ------------------------------------------------------------------ lookup and admission
    def match(self, prompt: PreparedPrompt) -> MatchResult:
        """Spec §6.1: the matched path and the valid snapshots on it."""
        return self.tree.match(prompt)

    def quote(self, prompt: PreparedPrompt, *, entitlement_pages: int, free_pages: int,
              total_pages: int, match: MatchResult | None = None) -> Quote:
        """Spec §6.2-6.3: choose the source (root, s*, s_dev) by cost, then check capacity in the
        fallback order chosen, s_dev, root.

        ``entitlement_pages`` is the lane's whole entitlement in page bundles (remaining prompt,
        bounded output window and cushion, counted from position 0); the fork shares
        ``F_s // 64`` of them, so ``need_pages(s) = entitlement - F_s//64 + host-only path blocks
        + host-only tail``. ``free_pages`` is the pools' free count, ``total_pages`` their size.
        """
        m = match if match is not None else self.tree.match(prompt)
        n = prompt.n
        path = m.path
        # Prefix scan up to the deepest candidate's anchor: host-only blocks, blocks in the LRU,
        # and the first block another admission is filling.
        deepest = max((s.anchor.depth for s in m.candidates), default=-1)
        host_only = [0] * (deepest + 2)
        in_lru = [0] * (deepest + 2)
        filling_at = deepest + 1
        ho = lr = 0
        for i in range(deepest + 1):
            node = path[i]
            st = node.device_state
            if st == ABSENT:
                ho += 1
            elif st == FILLING and filling_at > i:
                filling_at = i
            if node.lru_list is not None:
                lr += 1
            host_only[i + 1] = ho
            in_lru[i + 1] = lr
        evictable = len(self.lru_backed) + len(self.lru_unbacked)
        cost = self.cost
        bb = self.block_bytes

        def describe(s: Snapshot | None) -> tuple[int, int, int, float]:
            if s is None:
                return entitlement_pages, free_pages + evictable, 0, cost.prefill_seconds(0, n)
            d = s.anchor.depth + 1
            nbytes = host_only[d] * bb
            need = entitlement_pages - d + host_only[d]
            own = in_lru[d]
            if s.tail_tokens:
                if s.tail_device_state == ABSENT:
                    nbytes += bb
                    need += 1
                elif s.lru_list is not None:
                    own += 1
            if s.device_state != RESIDENT:
                nbytes += self.image_bytes
            secs = cost.restore_seconds(nbytes) + cost.prefill_seconds(s.frontier, n - s.frontier)
            return need, free_pages + evictable - own, nbytes, secs

        s_star = s_dev = None
        for s in reversed(m.candidates):
            if s.anchor.depth >= filling_at or s.tail_device_state == FILLING:
                continue  # another admission is filling a block of it (§6.3)
            if s_star is None:
                s_star = s
            if s.device_state == RESIDENT and host_only[s.anchor.depth + 1] == 0 and \
                    (not s.tail_tokens or s.tail_device_state == RESIDENT):
                s_dev = s
                break
        options: list[Snapshot | None] = [None]
        if s_star is not None:
            options.append(s_star)
        if s_dev is not None and s_dev is not s_star:
            options.append(s_dev)
        described = {id(s): describe(s) for s in options}
        # Minimum cost; ties favour fewer transferred bytes, then the deeper frontier.
        ranked = sorted(options, key=lambda s: (described[id(s)][3], described[id(s)][2],
                                                 -(s.frontier if s else 0)))
        chosen = ranked[0]
        order: list[Snapshot | None] = [chosen]
        for s in (s_dev, None):
            if s is not chosen and s not in order:
                order.append(s)
        found = False
        pick: Snapshot | None = None
        for s in order:
            need, avail, _, _ = described[id(s)]
            if need <= avail:
                pick, found = s, True
                break
        if found:
            readiness = Readiness.READY
        elif entitlement_pages > total_pages:
            readiness = Readiness.PERMANENTLY_INFEASIBLE
        else:
            readiness = Readiness.TEMPORARILY_BLOCKED
        src = pick
        need, avail, nbytes, secs = described[id(src)]
        d = src.anchor.depth + 1 if src is not None else 0
        qpath = path[:d]
        self.counters.quotes += 1
        return Quote(
            readiness=readiness, match=m, source=src,
            reuse_tokens=src.frontier if src is not None else 0,
            cached_prefix_tokens=m.cached_prefix_tokens, path=qpath,
            restore_blocks=[nd for nd in qpath if nd.device_state == ABSENT],
            restore_tail=bool(src is not None and src.tail_tokens and src.tail_device_state == ABSENT),
            restore_image=bool(src is not None and src.device_state != RESIDENT),
            restore_bytes=nbytes, need_pages=need, available_pages=avail, cost_seconds=secs,
            epoch=self.epoch, candidates=[(s, described[id(s)][3]) for s in options])

    def stage(self, quote: Quote, *, free_pages: int) -> Staged:
        """Spec §6.4 steps 1-2: re-validate, pin the path up to F_s and the source, count a hit,
        and evict from the device LRU until the pools hold ``quote.need_pages``."""
        if quote.epoch != self.epoch:
            raise StaleQuote(f"quote at epoch {quote.epoch}, cache now at {self.epoch}")
        if not quote.ready:
            raise ValueError(f"stage of a {quote.readiness.value} quote")
        self.epoch += 1
        self.tick += 1
        tick = self.tick
        seq = SequencePath(self._next_seq, [])
        self._next_seq += 1
        self.sequences[seq.id] = seq
        for node in quote.path:
            self._pin_node(node)
            node.last_access = tick
            seq.nodes.append(node)
            if node.device_state == ABSENT:
                self._awaiting_restore[node] = None
        s = quote.source
        if s is not None:
            self._pin_snapshot(s)
            seq.stage_pin = s
            seq.source = s
            seq.to_supersede = s
            seq.resumed_from_endpoint = s.kind is SnapshotKind.ENDPOINT
            self._hit(s)
        freed = Freed()
        want = quote.need_pages - free_pages
        if want > 0:
            freed = self.evict_device(want)
        short = max(0, want - len(freed.pages))
        self.counters.stages += 1
        self.counters.reuse_tokens += quote.reuse_tokens
        return Staged(seq, quote, freed, list(quote.restore_blocks), quote.restore_tail,
                      quote.restore_image, short)

    def begin_restore(self, staged: Staged, block_pages: Iterable[tuple[int, ...]] = (),
                      tail_pages: tuple[int, ...] | None = None) -> RestoreBatch | None:
        """Spec §6.4 step 3: the host-only blocks adopt ``block_pages`` (one bundle each, in
        path order) and become device Filling; a host-only tail takes ``tail_pages``; a host-only
        image is copied into the lane's own slot. None when nothing is host-only."""
        pages = list(block_pages)
        assert len(pages) == len(staged.restore_blocks), \
            f"{len(staged.restore_blocks)} host-only blocks need pages, got {len(pages)}"
        s = staged.quote.source
        if not pages and not staged.restore_tail and not staged.restore_image:
            return None
        self.epoch += 1
        batch = RestoreBatch(self._next_batch, [], None, staged.restore_image)
        self._next_batch += 1
        for node, pg in zip(staged.restore_blocks, pages):
            self._check_bundle(pg)
            assert node.alive and node.device_state == ABSENT and node.host_state == RESIDENT, \
                f"restore of {node!r}: needs a host-only node"
            self._awaiting_restore.pop(node, None)
            self.tally.count_node(node, -1)
            node.device_pages = tuple(pg)
            node.device_state = FILLING
            self.tally.count_node(node, +1)
            self._node_pins(node, +1)
            batch.blocks.append(BlockTransfer(node, node.device_pages, node.host_slab))
        if s is not None and (staged.restore_tail or staged.restore_image):
            st = SnapshotTransfer(s, -1, s.host_slabs if staged.restore_image else ())
            if staged.restore_tail:
                assert tail_pages is not None, "a host-only tail needs a page bundle"
                self._check_bundle(tail_pages)
                assert s.tail_device_state == ABSENT and s.tail_host_state == RESIDENT, \
                    f"tail restore of {s!r}: needs a host-only tail"
                self.tally.count_snapshot(s, -1)
                s.tail_pages = tuple(tail_pages)
                s.tail_device_state = FILLING
                self.tally.count_snapshot(s, +1)
                st.tail_pages = s.tail_pages
                st.tail_slab = s.tail_host_slab
            self._snap_pins(s, +1)
            batch.snapshot = st
        self._open_restore(batch)
        self.counters.restores += 1
        self.counters.restored_bytes += (len(batch.blocks) * self.block_bytes
                                         + (self.image_bytes if staged.restore_image else 0)
                                         + (self.block_bytes if staged.restore_tail else 0))
        return batch

    def land_restore(self, batch: RestoreBatch | None) -> None:
        """The restore batch's last event completed: its destinations are Resident and its
        pins drop (spec §6.5, poll)."""
        if batch is None:
            return
        assert not batch.landed, f"restore batch {batch.id} landed twice"
        batch.landed = True
        del self.restores[batch.id]
        self.tally.restore_bytes -= batch.nbytes
        for bt in batch.blocks:
            node = bt.node
            assert node.device_state == FILLING, f"landing {node!r}: not Filling"
            self.tally.count_node(node, -1)
            node.device_state = RESIDENT
            self.tally.count_node(node, +1)
            self._node_pins(node, -1)
        st = batch.snapshot
        if st is not None:
            s = st.snapshot
            if st.tail_pages is not None:
                s.tail_device_state = RESIDENT
            self._snap_pins(s, -1)

    def activate(self, staged: Staged) -> SequencePath:
        """The lane is built: it owns the path pins; the stage pin on the source drops."""
        seq = staged.seq
        assert not self._awaiting_restore.keys() & set(staged.restore_blocks), \
            "activate before begin_restore gave the host-only blocks their pages"
        if seq.stage_pin is not None:
            self._unpin_snapshot(seq.stage_pin)
            seq.stage_pin = None
        return seq

    def begin_sequence(self) -> SequencePath:
        """A cache-enabled sequence prefilled from the root without a quote (tests, warm paths)."""
        seq = SequencePath(self._next_seq, [])
        self._next_seq += 1
        self.sequences[seq.id] = seq
        return seq

    # ------------------------------------------------------------------ block commit (§7.6)
    def commit_block(self, seq: SequencePath, tokens: bytes, pages: tuple[int, ...], *,
                     extra: int = 0, h: int | None = None, media: tuple = ()) -> CommitOutcome:
        """Block ``len(seq.nodes)`` committed in every pool, written in the sequence's ``pages``.
        The node stays pinned for the sequence. ``media``: the Vision items its tokens hold
        (``extra`` is their key; kept on a new node for the cache file and inspection)."""
        assert not seq.released, f"commit on released sequence {seq.id}"
        self._check_bundle(pages)
        parent = seq.nodes[-1] if seq.nodes else self.tree.root
        assert parent.alive, f"commit below a deleted node {parent!r}"
        if h is None:
            h = lookup_hash(parent.hash, tokens, extra)
        node = self.tree.child(parent, h, tokens, extra)
        if node is not None and node.device_state != ABSENT:
            outcome = CommitOutcome.DUPLICATE
            seq.duplicate_pages.append(tuple(pages))
            self._pin_node(node)
        elif node is not None:
            outcome = CommitOutcome.ADOPTED
            self.tally.count_node(node, -1)
            node.active_refs += 1
            node.device_pages = tuple(pages)
            node.device_state = RESIDENT
            self.tally.count_node(node, +1)
            self._relink(node)
            self._update_dead(node)
        else:
            outcome = CommitOutcome.INSERTED
            node = self.tree.insert(parent, h, tokens, extra)
            node.media = tuple(media)
            node.active_refs = 1
            node.device_pages = tuple(pages)
            node.device_state = RESIDENT
            self.tally.count_node(node, +1)
            self._update_dead(parent)
        self.tick += 1
        node.last_access = self.tick
        seq.nodes.append(node)
        self.counters.commits[outcome.value] += 1
        return outcome

    # ------------------------------------------------------------------ snapshot slots (§9.2)
    def acquire_snapshot_slot(self, seq: SequencePath | None, kind: SnapshotKind, frontier: int,
                              tail_len: int | None = None) -> SlotGrant | None:
        """A device snapshot slot for a tap or endpoint at ``frontier``, in §9.2's order; the
        sequence's lineage is superseded first (§9.3). None: the snapshot is skipped."""
        if seq is not None:
            self._supersede_lineage(seq, kind, frontier)
        if tail_len is None:
            tail_len = frontier % BLOCK_TOKENS
        freed = Freed()
        if self._free_slots:
            slot = self._free_slots.pop()
            self.slot_owner[slot] = STAGING
            return SlotGrant(slot, freed, 1)
        # 2. a superseded owner, oldest supersession first
        for s in self._superseded:
            if s.device_slot >= 0 and s.restore_pins == 0:
                slot = s.device_slot
                if s.host_state == RESIDENT:
                    self._drop_device_image(s)
                else:
                    self._delete_snapshot(s, freed)
                return self._grant(slot, freed, 2)
        # 3. the least valuable device-only owner, if the new snapshot is worth as much
        prev = 0
        if seq is not None:
            prev = max((x.frontier for x in (seq.last_tap, seq.source) if x is not None and x.alive
                        and x.frontier < frontier), default=0)
        est = gdsf.estimate_priority(self.L, frontier, prev, tail_len > 0, self.cost,
                                     self.image_bytes, self.block_bytes)
        victim = None
        best = 0.0
        for o in self.slot_owner:
            if isinstance(o, Snapshot) and o.host_state == ABSENT and o.restore_pins == 0:
                h = self._h(o)
                if victim is None or h < best:
                    victim, best = o, h
        if victim is not None and est >= best:
            slot = victim.device_slot
            self.L = max(self.L, best)
            self._delete_snapshot(victim, freed)
            self.counters.slot_value_evictions += 1
            return self._grant(slot, freed, 3)
        # 4. the least recently hit host-backed owner loses its device copy
        victim = None
        for o in self.slot_owner:
            if isinstance(o, Snapshot) and o.host_state == RESIDENT and o.restore_pins == 0:
                if victim is None or o.last_hit_tick < victim.last_hit_tick:
                    victim = o
        if victim is not None:
            slot = victim.device_slot
            self._drop_device_image(victim)
            return self._grant(slot, freed, 4)
        self.counters.taps_skipped_no_slot += 1
        return None

    def release_snapshot_slot(self, slot: int) -> None:
        """Give back a staged slot whose tap was dropped."""
        assert self.slot_owner[slot] == STAGING, f"slot {slot} is not staged: {self.slot_owner[slot]!r}"
        self.slot_owner[slot] = None
        self._free_slots.append(slot)

    def _grant(self, slot: int, freed: Freed, step: int) -> SlotGrant:
        assert self.slot_owner[slot] is None, f"slot {slot} still owned"
        self._free_slots.remove(slot)
        self.slot_owner[slot] = STAGING
        if slot in freed.slots:
            freed.slots.remove(slot)  # handed straight to the new snapshot
        return SlotGrant(slot, freed, step)

    # ------------------------------------------------------------------ publication (§7.4, §7.7)
    def publish(self, seq: SequencePath, kind: SnapshotKind, frontier: int, *, slot: int,
                tail_tokens: bytes = b"", tail_pages: tuple[int, ...] | None = None,
                write_through: bool = True, tail_extra: int = 0) -> PublishResult:
        """Publish the snapshot at ``frontier`` of ``seq`` (its anchor block, and the tail block
        for a frontier inside a block, are committed). A duplicate (anchor, tail) refreshes the
        existing snapshot's recency and gives back the slot and tail pages."""
        assert not seq.released, f"publish on released sequence {seq.id}"
        assert self.slot_owner[slot] == STAGING, f"publish into slot {slot} not staged: {self.slot_owner[slot]!r}"
        d = frontier // BLOCK_TOKENS
        tail_len = frontier - BLOCK_TOKENS * d
        assert len(tail_tokens) == 4 * tail_len, f"frontier {frontier} needs {tail_len} tail tokens"
        assert (tail_pages is not None) == (tail_len > 0), "a tail page bundle iff the frontier is inside a block"
        assert len(seq.nodes) >= d, f"publish at {frontier}: only {len(seq.nodes)} blocks committed"
        anchor = seq.nodes[d - 1] if d > 0 else self.tree.root
        self._supersede_lineage(seq, kind, frontier)
        freed = Freed()
        for s in anchor.snapshots:
            if s.tail_tokens == tail_tokens and s.tail_extra == tail_extra:
                self.tick += 1
                s.last_hit_tick = self.tick
                if s.superseded:
                    self._retain(s)
                self.release_snapshot_slot(slot)
                if tail_pages is not None:
                    freed.pages.append(tuple(tail_pages))
                if kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
                    seq.last_tap = s
                self.counters.publish_duplicates += 1
                return PublishResult(s, True, None, freed)
        self.tick += 1
        s = Snapshot(self._next_snapshot, anchor, frontier, kind, tail_tokens, tail_extra,
                     device_slot=slot, device_state=RESIDENT, published_tick=self.tick,
                     last_hit_tick=self.tick, l_base=self.L)
        self._next_snapshot += 1
        if tail_pages is not None:
            self._check_bundle(tail_pages)
            s.tail_pages = tuple(tail_pages)
            s.tail_device_state = RESIDENT
        self.slot_owner[slot] = s
        self.tally.count_snapshot(s, +1)
        self._attach_snapshot(s)
        self._relink_tail(s)
        if kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
            seq.last_tap = s
        self.counters.published[kind.value] += 1
        write = None
        if write_through and self.host.enabled:
            write = self._begin_snapshot_write(s, freed)
        return PublishResult(s, False, write, freed)

    def _begin_snapshot_write(self, s: Snapshot, freed: Freed) -> WriteBatch | None:
        k = self.image_slabs + (1 if s.tail_tokens else 0)
        h_new = self._h(s)
        self._snap_pins(s, +1)  # keep s (and its tail) out of the victims while making room
        slabs = self._host_alloc(k, SlabUse.IMAGE, s, freed, bound=h_new)
        self._snap_pins(s, -1)
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
        self._snap_pins(s, +1)
        batch = WriteBatch(self._next_batch, [], [st])
        self._next_batch += 1
        self._open_write(batch)
        return batch

    # ------------------------------------------------------------------ release (§7.7)
    def release(self, seq: SequencePath, *, write_through: bool = True) -> Release:
        """Terminal settlement: enqueue write-through of the path's device-only nodes (one batch),
        then active_refs-- in reverse block order so deeper blocks reach the LRU head first."""
        assert not seq.released, f"sequence {seq.id} released twice"
        seq.released = True
        if seq.stage_pin is not None:
            self._unpin_snapshot(seq.stage_pin)
            seq.stage_pin = None
        for node in seq.nodes:
            if node in self._awaiting_restore:
                raise AssertionError(f"release of sequence {seq.id} before its restore was begun")
        write = None
        freed = Freed()
        if write_through and self.host.enabled:
            blocks = []
            for node in seq.nodes:
                if node.host_state == ABSENT and node.device_state == RESIDENT and node.alive:
                    slabs = self._host_alloc(1, SlabUse.NODE, node, freed)
                    if slabs is None:
                        self.counters.block_writes_refused += 1
                        break
                    self.tally.count_node(node, -1)
                    node.host_slab = slabs[0]
                    node.host_state = FILLING
                    self.tally.count_node(node, +1)
                    self._node_pins(node, +1)
                    self._dirty_sole_owner(node)
                    blocks.append(BlockTransfer(node, node.device_pages, node.host_slab))
            if blocks:
                write = WriteBatch(self._next_batch, blocks, [])
                self._next_batch += 1
                self._open_write(write)
        for node in reversed(seq.nodes):
            self.tally.count_node(node, -1)
            node.active_refs -= 1
            self.tally.count_node(node, +1)
            assert node.active_refs >= 0, f"{node!r}: active_refs below zero"
            self._relink(node)
            self._update_dead(node)
        del self.sequences[seq.id]
        self.epoch += 1
        pages = seq.duplicate_pages
        seq.duplicate_pages = []
        return Release(pages, write, freed)

    def land_write(self, batch: WriteBatch | None) -> None:
        """Write-through completed: host copies become Resident and the sources unpin. Blocks
        join the backed LRU deepest first (tail-first order, §9.1)."""
        if batch is None:
            return
        assert not batch.landed, f"write batch {batch.id} landed twice"
        batch.landed = True
        del self.writes[batch.id]
        self.tally.write_bytes -= batch.nbytes
        for bt in sorted(batch.blocks, key=lambda b: -b.node.depth):
            node = bt.node
            assert node.host_state == FILLING, f"landing write of {node!r}: not Filling"
            self.tally.count_node(node, -1)
            node.host_state = RESIDENT
            self.tally.count_node(node, +1)
            self._node_pins(node, -1)
            self._dirty_sole_owner(node)
        for st in batch.snapshots:
            s = st.snapshot
            s.host_state = RESIDENT
            if s.tail_tokens:
                s.tail_host_state = RESIDENT
            self._snap_pins(s, -1)
        self.counters.writes_landed += 1

    # ------------------------------------------------------------------ supersession (§9.3)
    def supersede(self, s: Snapshot) -> bool:
        """Mark ``s`` superseded (only a retry or edit diverging before its successor can still
        use it). A Boundary snapshot is superseded only while the tree below it is one chain."""
        if not s.alive or s.superseded:
            return False
        if s.kind is SnapshotKind.BOUNDARY and not self._single_chain_below(s):
            return False
        self.tick += 1
        s.superseded = True
        s.superseded_tick = self.tick
        self._superseded[s] = None
        s.dirty = True
        self._path_retained(s, -1)
        self._dirty_dependents(s)
        self.counters.superseded += 1
        return True

    def _retain(self, s: Snapshot) -> None:
        """A hit on a superseded snapshot retains it again."""
        s.superseded = False
        del self._superseded[s]
        self._path_retained(s, +1)
        self._dirty_dependents(s)
        s.dirty = True
        self.counters.retained_again += 1

    def _supersede_lineage(self, seq: SequencePath, kind: SnapshotKind, frontier: int) -> None:
        targets = [seq.to_supersede]
        if kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
            targets.append(seq.last_tap)
        for t in targets:
            if t is not None and t.alive and t.frontier < frontier and not t.superseded:
                self.supersede(t)
        seq.to_supersede = None

    def _single_chain_below(self, s: Snapshot) -> bool:
        """True while no other conversation continued from ``s``: below it the tree is a chain."""
        node, prefix = s.anchor, s.tail_tokens
        while True:
            conts: list[BlockNode] = [c for c in node.iter_children() if c.tokens.startswith(prefix)]
            if len(conts) > 1:
                return False
            child = conts[0] if conts else None
            for t in node.snapshots:
                if t is s or len(t.tail_tokens) <= len(prefix) or not t.tail_tokens.startswith(prefix):
                    continue
                if child is None or not child.tokens.startswith(t.tail_tokens):
                    return False  # a tail ends a second continuation
            if child is None:
                return True
            node, prefix = child, b""

    # ------------------------------------------------------------------ device LRU (§9.1)
    def evictable_pages(self) -> int:
        return len(self.lru_backed) + len(self.lru_unbacked)

    def evict_device(self, pages: int) -> Freed:
        """Free at least ``pages`` page bundles from the device LRU head, backed entries first.
        A backed entry loses its device copy; an unbacked one its last copy (§9.4)."""
        freed = Freed()
        if pages <= 0:
            return freed
        self.epoch += 1
        while len(freed.pages) < pages:
            e = self.lru_backed.head()
            if e is not None:
                if isinstance(e, BlockNode):
                    freed.pages.append(self._drop_device_node(e))
                else:
                    freed.pages.append(self._drop_device_tail(e))
                self.counters.device_evictions_backed += 1
                continue
            skipped = 0
            while True:
                e = self.lru_unbacked.head()
                if e is None or skipped >= len(self.lru_unbacked):
                    return freed
                if isinstance(e, BlockNode):
                    if self._subtree_pinned(e):
                        self.lru_unbacked.move_to_mru(e)  # a transfer still reads below it
                        skipped += 1
                        continue
                    self._delete_subtree(e, freed)
                else:
                    self._delete_snapshot(e, freed)
                self.counters.device_evictions_unbacked += 1
                break
        return freed

    # ------------------------------------------------------------------ prefetch (§6.6)
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

    def evict_backed(self, pages: int, keep: Iterable[BlockNode] = ()) -> Freed:
        """Free up to ``pages`` host-backed device copies, least recently used first, never a
        node in ``keep`` and never a last copy (a prefetch's room, spec §6.6)."""
        freed = Freed()
        keep = set(keep)
        self.epoch += 1
        skipped = 0
        while len(freed.pages) < pages and skipped < len(self.lru_backed):
            e = self.lru_backed.head()
            if e in keep:
                self.lru_backed.move_to_mru(e)  # the head's own path stays (it is about to be hit)
                skipped += 1
                continue
            if isinstance(e, BlockNode):
                freed.pages.append(self._drop_device_node(e))
            else:
                freed.pages.append(self._drop_device_tail(e))
            self.counters.device_evictions_backed += 1
        return freed

    def begin_prefetch(self, nodes: list[BlockNode], pages: Iterable[tuple[int, ...]]) -> RestoreBatch | None:
        """Copy host-only ``nodes`` into ``pages`` (one bundle each): they are Filling and pinned
        until :meth:`land_restore`, then ordinary cached blocks at the MRU end of the LRU."""
        pages = list(pages)
        assert len(pages) == len(nodes), f"{len(nodes)} prefetched blocks need pages, got {len(pages)}"
        if not nodes:
            return None
        self.epoch += 1
        batch = RestoreBatch(self._next_batch, [], None, False)
        self._next_batch += 1
        for node, pg in zip(nodes, pages):
            self._check_bundle(pg)
            assert node.alive and node.device_state == ABSENT and node.host_state == RESIDENT, \
                f"prefetch of {node!r}: needs a host-only node"
            self.tally.count_node(node, -1)
            node.device_pages = tuple(pg)
            node.device_state = FILLING
            self.tally.count_node(node, +1)
            self._node_pins(node, +1)
            batch.blocks.append(BlockTransfer(node, node.device_pages, node.host_slab))
        self._open_restore(batch)
        self.counters.prefetches += 1
        self.counters.prefetched_blocks += len(nodes)
        return batch

    def touch(self, nodes: Iterable[BlockNode]) -> None:
        """A hit: unpinned device-resident nodes move to the MRU end, shallow first (so the
        deepest stays nearest the head among them)."""
        self.tick += 1
        for node in reversed(list(nodes)):
            node.last_access = self.tick
            if node.lru_list is not None:
                node.lru_list.move_to_mru(node)

    # ------------------------------------------------------------------ host allocation (§9.3)
    def grow_host(self, ready_slabs: int) -> int:
        """The memory layer made slabs up to ``ready_slabs`` usable (a chunk finished pinning):
        they join the free list. Returns how many were added."""
        return self.host.grow(ready_slabs)

    def _host_alloc(self, k: int, use: SlabUse, owner: object, freed: Freed,
                    bound: float | None = None) -> list[int] | None:
        pool = self.host
        if k > pool.ready_slabs:  # more than the tier holds now: evicting would not make room
            return None
        while pool.free_slabs < k:
            if self._dead:  # 1. dead KV, leaves first
                node = next(iter(self._dead))
                self._drop_host_node(node, freed)
                self.counters.dead_kv_reclaimed += 1
                continue
            victim = next((s for s in self._superseded if s.restore_pins == 0), None)
            if victim is not None:  # 2. the oldest superseded snapshot, entirely
                self._delete_snapshot(victim, freed)
                self.counters.host_superseded_evictions += 1
                continue
            victim, hv = self._gdsf_victim()  # 3. minimum H
            if victim is None:
                return None
            if bound is not None and hv > bound:
                return None  # GDSF never inserts what it would evict next
            self.L = max(self.L, hv)
            self.counters.host_gdsf_evictions += 1
            if victim.device_complete:
                self._drop_host_snapshot(victim, freed)
            else:
                self._delete_snapshot(victim, freed)
        slabs = pool.alloc(k, use, owner)
        return slabs

    def _gdsf_victim(self) -> tuple[Snapshot | None, float]:
        victim, best = None, 0.0
        for s in self.snapshots.values():
            if s.superseded or s.restore_pins or (s.host_state == ABSENT and s.tail_host_state == ABSENT):
                continue
            h = self._h(s)
            if victim is None or h < best:
                victim, best = s, h
        return victim, best

    def host_victim(self) -> tuple[Snapshot | None, float]:
        """The snapshot host allocation would evict at §9.3 step 3 now, and its H."""
        return self._gdsf_victim()

    def priority(self, s: Snapshot) -> float:
        """H(s) of spec §9.3 (recomputed when stale)."""
        return self._h(s)

    def _h(self, s: Snapshot) -> float:
        if s.dirty:
            s.gdsf_c = gdsf.value_c(s, self.cost, self.image_bytes)
            s.gdsf_z = gdsf.size_z(s, self.image_bytes, self.block_bytes)
            s.gdsf_h = gdsf.priority(s.l_base, s.hits, s.gdsf_c, s.gdsf_z)
            s.dirty = False
        return s.gdsf_h

    def _hit(self, s: Snapshot) -> None:
        self.tick += 1
        s.hits += 1
        s.last_hit_tick = self.tick
        s.l_base = self.L
        s.dirty = True
        if s.superseded:
            self._retain(s)
        self.counters.snapshot_hits += 1

    # ------------------------------------------------------------------ explicit copy loss
    def drop_copy(self, node: BlockNode, *, device: bool = False, host: bool = False) -> Freed:
        """Drop a node's device and/or host copy (an unpinned node only), e.g. after a failed
        transfer; a node left with no copy is deleted with its subtree (§9.4)."""
        assert node.alive and not node.is_root, f"drop_copy of {node!r}"
        assert not node.pinned, f"drop_copy of pinned {node!r}"
        freed = Freed()
        self.epoch += 1
        has_dev = node.device_state == RESIDENT
        has_host = node.host_state == RESIDENT
        keep_dev = has_dev and not device
        keep_host = has_host and not host
        if not keep_dev and not keep_host:
            assert not self._subtree_pinned(node), f"drop_copy of {node!r}: something below it is pinned"
            self._delete_subtree(node, freed)
        elif device and has_dev:
            freed.pages.append(self._drop_device_node(node))
        elif host and has_host:
            self._drop_host_node(node, freed)
        return freed

    # ------------------------------------------------------------------ internals: residency
    def _check_bundle(self, pages: tuple[int, ...] | list[int]) -> None:
        assert len(pages) == self.geometry.num_pools, \
            f"a page bundle has one page per pool ({self.geometry.num_pools}), got {tuple(pages)}"

    def _pin_node(self, node: BlockNode) -> None:
        if not node.pinned:
            self.tally.nodes_pinned += 1
        node.active_refs += 1
        if node.lru_list is not None:
            node.lru_list.remove(node)
        self._dead.pop(node, None)

    def _pin_snapshot(self, s: Snapshot) -> None:
        self._snap_pins(s, +1)

    def _unpin_snapshot(self, s: Snapshot) -> None:
        self._snap_pins(s, -1)

    def _node_pins(self, node: BlockNode, delta: int) -> None:
        was = node.pinned
        node.restore_pins += delta
        assert node.restore_pins >= 0, f"{node!r}: restore_pins below zero"
        self.tally.nodes_pinned += node.pinned - was
        self._self_pin(node)
        self._relink(node)
        self._update_dead(node)

    def _snap_pins(self, s: Snapshot, delta: int) -> None:
        before = s.restore_pins
        s.restore_pins += delta
        assert s.restore_pins >= 0, f"{s!r}: restore_pins below zero"
        if (before > 0) != (s.restore_pins > 0):
            s.anchor.pinned_snaps += 1 if delta > 0 else -1
            self._self_pin(s.anchor)
        self._relink_tail(s)

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
            self._relink(n)
            if (before > 0) == (n.pin_mass > 0):
                break
            n = n.parent

    def _relink(self, node: BlockNode) -> None:
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

    def _relink_tail(self, s: Snapshot) -> None:
        if s.alive and s.tail_device_state == RESIDENT and s.restore_pins == 0:
            target = self.lru_backed if s.tail_host_state == RESIDENT else self.lru_unbacked
        else:
            target = None
        _move(s, target)

    def _update_dead(self, node: BlockNode) -> None:
        """Dead KV (§9.3 step 1): host Resident, no snapshot below, no refs or pins; a node with
        no device copy qualifies only as a leaf (so the sweep goes leaves first)."""
        if node.parent is None:
            return
        dead = (node.alive and node.host_state == RESIDENT and node.live_snapshots_below == 0
                and node.active_refs == 0 and node.restore_pins == 0
                and (node.device_state != ABSENT or node.n_children == 0))
        if dead:
            if node not in self._dead:
                self._dead[node] = None
        else:
            self._dead.pop(node, None)

    def _drop_device_node(self, node: BlockNode) -> tuple[int, ...]:
        assert node.device_state == RESIDENT and node.host_state == RESIDENT and not node.pinned, \
            f"dropping the device copy of {node!r}"
        pages = node.device_pages
        assert pages is not None
        self.tally.count_node(node, -1)
        node.device_pages = None
        node.device_state = ABSENT
        self.tally.count_node(node, +1)
        self._relink(node)
        self._update_dead(node)
        return pages

    def _drop_device_tail(self, s: Snapshot) -> tuple[int, ...]:
        assert s.tail_device_state == RESIDENT and s.tail_host_state == RESIDENT and s.restore_pins == 0
        pages = s.tail_pages
        assert pages is not None
        self.tally.count_snapshot(s, -1)
        s.tail_pages = None
        s.tail_device_state = ABSENT
        self.tally.count_snapshot(s, +1)
        self._relink_tail(s)
        return pages

    def _drop_device_image(self, s: Snapshot) -> None:
        assert s.host_state == RESIDENT and s.restore_pins == 0, f"dropping the device image of {s!r}"
        slot = s.device_slot
        self.slot_owner[slot] = None
        self._free_slots.append(slot)
        self.tally.count_snapshot(s, -1)
        s.device_slot = -1
        s.device_state = ABSENT
        self.tally.count_snapshot(s, +1)
        self.epoch += 1

    def _drop_host_node(self, node: BlockNode, freed: Freed) -> None:
        assert node.host_state == RESIDENT and not node.pinned, f"dropping the host copy of {node!r}"
        if node.device_state == ABSENT:
            self._delete_subtree(node, freed)
            return
        self.host.free((node.host_slab,))
        freed.slabs.append(node.host_slab)
        self.tally.count_node(node, -1)
        node.host_slab = -1
        node.host_state = ABSENT
        self.tally.count_node(node, +1)
        self._dead.pop(node, None)
        self._relink(node)
        self._dirty_sole_owner(node)
        self.epoch += 1

    def _drop_host_snapshot(self, s: Snapshot, freed: Freed) -> None:
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
            self._relink_tail(s)
        self.epoch += 1

    def _dirty_sole_owner(self, node: BlockNode) -> None:
        if node.retained_below == 1:
            s = self.snapshots.get(node.retained_xor)
            if s is not None:
                s.dirty = True

    def _dirty_dependents(self, s: Snapshot) -> None:
        stack = list(s.dependents)
        while stack:
            d = stack.pop()
            d.dirty = True
            if d.superseded:
                stack.extend(d.dependents)

    def _path_retained(self, s: Snapshot, delta: int) -> None:
        n = s.anchor
        sid = s.id
        snaps = self.snapshots
        while n.parent is not None:
            n.retained_below += delta
            n.retained_xor ^= sid
            if (delta > 0 and n.retained_below == 2) or (delta < 0 and n.retained_below == 1):
                other = snaps.get(n.retained_xor ^ sid if delta > 0 else n.retained_xor)
                if other is not None:
                    other.dirty = True
            n = n.parent

    def _link_ancestor(self, s: Snapshot) -> None:
        """Find the nearest snapshot above ``s`` and take over its dependents below ``s``."""
        anc = None
        for t in s.anchor.snapshots:
            if t is not s and len(t.tail_tokens) < len(s.tail_tokens) and s.tail_tokens.startswith(t.tail_tokens) \
                    and t.tail_extra == s.tail_extra:  # as Snapshot.covers
                if anc is None or t.frontier > anc.frontier:
                    anc = t
        if anc is None:
            child, n = s.anchor, s.anchor.parent
            while n is not None and anc is None:
                if n.snapshots:
                    for t in n.snapshots:
                        if child.tokens.startswith(t.tail_tokens) and not t.tail_extra \
                                and (anc is None or t.frontier > anc.frontier):
                            anc = t
                child, n = n, n.parent
        s.ancestor = anc
        siblings = anc.dependents if anc is not None else self._top
        moved = [d for d in siblings if d.frontier > s.frontier and s.covers(d)]
        for d in moved:
            del siblings[d]
            d.ancestor = s
            s.dependents[d] = None
            d.dirty = True
            if d.superseded:
                self._dirty_dependents(d)
        siblings[s] = None

    # ------------------------------------------------------------------ internals: deletion (§9.4)
    def _subtree_pinned(self, node: BlockNode) -> bool:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.active_refs or n.restore_pins or any(s.restore_pins for s in n.snapshots):
                return True
            stack.extend(n.iter_children())
        return False

    def _delete_subtree(self, node: BlockNode, freed: Freed) -> None:
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
                self._delete_snapshot(s, freed)
        parent = node.parent
        for n in reversed(order):  # children before parents
            self.tally.count_node(n, -1)
            if n.lru_list is not None:
                n.lru_list.remove(n)
            self._dead.pop(n, None)
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
            self._update_dead(parent)
        self.epoch += 1

    def _delete_snapshot(self, s: Snapshot, freed: Freed) -> None:
        assert s.alive and s.restore_pins == 0, f"deleting pinned or dead {s!r}"
        self.tally.count_snapshot(s, -1)
        s.anchor.snapshots.remove(s)
        if s.superseded:
            del self._superseded[s]
        n = s.anchor
        sid = s.id
        retained = not s.superseded
        snaps = self.snapshots
        while n.parent is not None:
            n.live_snapshots_below -= 1
            if retained:
                n.retained_below -= 1
                n.retained_xor ^= sid
                if n.retained_below == 1:
                    o = snaps.get(n.retained_xor)
                    if o is not None:
                        o.dirty = True
            if n.live_snapshots_below == 0:
                self._update_dead(n)
            n = n.parent
        # hand dependents to the ancestor
        anc = s.ancestor
        up = anc.dependents if anc is not None else self._top
        del up[s]
        for d in s.dependents:
            d.ancestor = anc
            up[d] = None
            d.dirty = True
            if d.superseded:
                self._dirty_dependents(d)
        s.dependents.clear()
        del snaps[sid]
        if s.device_slot >= 0:
            self.slot_owner[s.device_slot] = None
            self._free_slots.append(s.device_slot)
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
        self.epoch += 1

    # ------------------------------------------------------------------ host-only adoption (§5.5)
    def reserve_host_slabs(self, k: int, keep: Iterable[BlockNode] = ()) -> tuple[list[int] | None, Freed]:
        """Take ``k`` host slabs for entries about to be adopted (:meth:`adopt_host_node`,
        :meth:`adopt_host_snapshot`; the shared tier's fetches), making room by host eviction
        (§9.3) while the nodes of ``keep`` (the path they go under) are pinned. Returns the slabs,
        or None when the tier cannot make room, and what the eviction freed."""
        freed = Freed()
        keep = list(keep)
        for node in keep:
            self._node_pins(node, +1)
        try:
            slabs = self._host_alloc(k, SlabUse.NODE, "adopting", freed)
        finally:
            for node in keep:
                self._node_pins(node, -1)
        return slabs, freed

    def adopt_host_node(self, parent: BlockNode, tokens: bytes, extra: int, slab: int, *,
                        h: int | None = None, media: tuple = ()) -> BlockNode:
        """Rebuild a block from a cache file: a new host-only child of ``parent`` whose bytes are
        already in host slab ``slab`` (taken from :attr:`host` by the loader; it becomes the
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
        self._update_dead(node)
        self._update_dead(parent)
        self.epoch += 1
        return node

    def adopt_host_snapshot(self, anchor: BlockNode, frontier: int, kind: SnapshotKind, *,
                            tail_tokens: bytes = b"", hits: int = 0, image_slabs: tuple[int, ...],
                            tail_slab: int = -1, tail_extra: int = 0) -> Snapshot:
        """Rebuild a retained snapshot from a cache file, host-only: its image (and tail) bytes are
        already in ``image_slabs`` (and ``tail_slab``), taken from :attr:`host` by the loader."""
        assert anchor.alive, f"adopt on a deleted anchor {anchor!r}"
        assert frontier == anchor.end + len(tail_tokens) // 4, f"frontier {frontier} vs anchor {anchor!r}"
        assert len(image_slabs) == self.image_slabs, f"an image takes {self.image_slabs} slabs"
        assert (tail_slab >= 0) == bool(tail_tokens), "a tail slab iff the snapshot has a tail"
        assert all(t.tail_tokens != tail_tokens or t.tail_extra != tail_extra for t in anchor.snapshots), \
            "adopt of a duplicate snapshot"
        self.tick += 1
        s = Snapshot(self._next_snapshot, anchor, frontier, kind, tail_tokens, tail_extra, hits=hits,
                     published_tick=self.tick, last_hit_tick=self.tick, l_base=self.L)
        self._next_snapshot += 1
        self._reown(tuple(image_slabs), SlabUse.IMAGE, s)
        s.host_slabs = tuple(image_slabs)
        s.host_state = RESIDENT
        if tail_tokens:
            self._reown((tail_slab,), SlabUse.TAIL, s)
            s.tail_host_slab = tail_slab
            s.tail_host_state = RESIDENT
        self.tally.count_snapshot(s, +1)
        self._attach_snapshot(s)
        self.epoch += 1
        return s

    def _attach_snapshot(self, s: Snapshot) -> None:
        """Register a new snapshot on its anchor: live_snapshots_below and the retained counts
        along its path (dead KV below it comes back to life), then its nearest ancestor."""
        anchor = s.anchor
        self.snapshots[s.id] = s
        anchor.snapshots.append(s)
        n = anchor
        sid = s.id
        while n.parent is not None:
            n.live_snapshots_below += 1
            if n.live_snapshots_below == 1 and n in self._dead:
                del self._dead[n]
            n.retained_below += 1
            n.retained_xor ^= sid
            if n.retained_below == 2:
                other = self.snapshots.get(n.retained_xor ^ sid)
                if other is not None:
                    other.dirty = True
            n = n.parent
        self._link_ancestor(s)

    def _reown(self, slabs: tuple[int, ...], use: SlabUse, owner: object) -> None:
        """Hand slabs the loader took from the pool to their entry (free then re-take: the free
        stack returns exactly these ids)."""
        pool = self.host
        pool.free(tuple(reversed(slabs)))
        got = pool.alloc(len(slabs), use, owner)
        assert got is not None and tuple(got) == tuple(slabs), f"reown of slabs {slabs} got {got}"

    def _open_restore(self, batch: RestoreBatch) -> None:
        batch.nbytes = restore_batch_bytes(batch, self.block_bytes, self.image_bytes)
        self.restores[batch.id] = batch
        self.tally.restore_bytes += batch.nbytes

    def _open_write(self, batch: WriteBatch) -> None:
        batch.nbytes = write_batch_bytes(batch, self.block_bytes, self.image_bytes)
        self.writes[batch.id] = batch
        self.tally.write_bytes += batch.nbytes

    # ------------------------------------------------------------------ views
    def check_invariants(self) -> None:
        from hpc_cli.cache.invariants import check_invariants
        check_invariants(self)

    def stats(self, *, recount: bool = False) -> dict:
        """The index as a JSON-able dict (:func:`hpc_cli.cache.stats.summary`, O(1)); with
        ``recount`` every count is taken by a full walk instead (tests, debugging)."""
        from hpc_cli.cache import stats
        return stats.stats(self) if recount else stats.summary(self)


def backfill_proof(need_borrower: int, need_head_root: int, free_pages: int, evictable_pages: int,
                   donor_released_pages: int) -> bool:
    """Spec §6.3's backfill arithmetic: a borrower may overtake a blocked FIFO head only if
    ``need(borrower) + need(head root) <= free + all evictable + donor entitlements released``.
    Hybrid mode does not issue the proof (a blocked head is never overtaken); it is kept as a
    function so the arithmetic is tested and available."""
    return need_borrower + need_head_root <= free_pages + evictable_pages + donor_released_pages


def _move(entry, target: LruList | None) -> None:
    """Put a node or snapshot tail in ``target`` (None: no list), left in place if already there."""
    cur = entry.lru_list
    if cur is not target:
        if cur is not None:
            cur.remove(entry)
        if target is not None:
            target.append(entry)


def _root_hash() -> int:
    from hpc_cli.cache.keys import HASH_SEED
    return HASH_SEED
