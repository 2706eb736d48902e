"""PrefixIndex: the hybrid prefix cache's model-agnostic index (spec §5, §6.1-6.4, §7.4-7.7, §9).

The index records page ids, slab ids and snapshot slot ids; it never touches memory. Every
call that frees something returns what to free (:class:`~hpc_cli.cache.records.Freed`) and
every transfer it asks for is a batch (:class:`~hpc_cli.cache.records.RestoreBatch`,
:class:`~hpc_cli.cache.records.WriteBatch`) whose copies the memory layer runs and then reports
with :meth:`PrefixIndex.land_restore` / :meth:`PrefixIndex.land_write`. One worker thread is the
only caller (spec §10.9).

This class is the spec's verbs; each idea lives in its own room, which the verbs compose:
records (:mod:`~hpc_cli.cache.records`), admission's choice (:mod:`~hpc_cli.cache.admission`),
residency and the device LRU (:mod:`~hpc_cli.cache.residency`), transfers
(:mod:`~hpc_cli.cache.transfers`), supersession and lineage
(:mod:`~hpc_cli.cache.supersession`), snapshot slots (:mod:`~hpc_cli.cache.slots`), host
eviction (:mod:`~hpc_cli.cache.eviction`, :mod:`~hpc_cli.cache.gdsf`) and adoption from the
cache file (:mod:`~hpc_cli.cache.adoption`). The engine's flow, in the spec's words::

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

from typing import Iterable

from hpc_cli.cache import admission, gdsf
from hpc_cli.cache.adoption import Adoption
from hpc_cli.cache.cost import GENERIC, CacheCostModel
from hpc_cli.cache.eviction import SpecHostEviction
from hpc_cli.cache.host import HostSlabPool, image_slabs
from hpc_cli.cache.ids import PageBundle, SnapshotSlot
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, PreparedPrompt, lookup_hash
from hpc_cli.cache.records import STAGING, CacheGeometry, Clock, CommitOutcome, Freed, PublishResult, Quote
from hpc_cli.cache.records import Release, RestoreBatch, SequencePath, SlotGrant, Staged, StaleQuote, WriteBatch
from hpc_cli.cache.residency import DeadKv, ResidencyLedger
from hpc_cli.cache.slots import SlotGrants, SlotTable
from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.stats import Counters, IndexStats, Tally
from hpc_cli.cache.supersession import Lineage
from hpc_cli.cache.transfers import Transfers
from hpc_cli.cache.tree import ABSENT, RESIDENT, BlockTree, MatchResult
from hpc_cli.errors import CapacityError


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
        self.tree.root.hash = HASH_SEED
        self.host = HostSlabPool(geometry.host_bytes, geometry.slab, geometry.image_bytes,
                                 chunk_bytes=geometry.chunk_bytes, ready_slabs=host_ready_slabs)
        self.image_slabs = image_slabs(geometry.image_bytes, geometry.slab)
        self.clock = Clock()
        self.counters = Counters()
        #: gauges kept up to date at every change of state (stats.summary reads them, O(1));
        #: check_invariants compares them with a full recount
        self.tally = Tally()
        self.priority = gdsf.Priority(cost, geometry.image_bytes, geometry.block_bytes)
        self.slots = SlotTable(geometry.device_snapshot_slots)
        self.lineage = Lineage(DeadKv(), self.clock, self.counters)
        self.residency = ResidencyLedger(self.tree, self.host, self.slots, self.lineage, self.tally,
                                         self.counters, self.clock, geometry.num_pools)
        self.eviction = SpecHostEviction(self.residency, self.lineage, self.priority, self.clock,
                                         self.counters)
        self.grants = SlotGrants(self.slots, self.residency, self.lineage, self.priority, self.clock,
                                 self.counters)
        self.transfers = Transfers(self.residency, self.lineage, self.eviction, self.priority,
                                   self.image_slabs)
        self.adoption = Adoption(self.residency, self.lineage, self.eviction, self.image_slabs)
        self.sequences: dict[int, SequencePath] = {}
        self._next_seq = 1
        # the rooms' tables, read by stats, invariants, the engine and tests
        self.snapshots: dict[int, Snapshot] = self.lineage.snapshots
        self.slot_owner = self.slots.owner
        self.lru_backed = self.residency.lru_backed
        self.lru_unbacked = self.residency.lru_unbacked
        self.restores: dict[int, RestoreBatch] = self.transfers.restores
        self.writes: dict[int, WriteBatch] = self.transfers.writes
        # what the rooms do on their own, as the index's verbs
        self.evict_device = self.residency.evict_device
        self.evict_backed = self.residency.evict_backed
        self.evictable_pages = self.residency.evictable_pages
        self.touch = self.residency.touch
        self.drop_copy = self.residency.drop_copy
        self.land_restore = self.transfers.land_restore
        self.land_write = self.transfers.land_write
        self.prefetch_candidates = self.transfers.prefetch_candidates
        self.begin_prefetch = self.transfers.prefetch
        self.supersede = self.lineage.supersede
        self.release_snapshot_slot = self.slots.release
        self.reserve_host_slabs = self.adoption.reserve_host_slabs
        self.release_host_slabs = self.adoption.release_host_slabs
        self.adopt_host_node = self.adoption.adopt_host_node
        self.adopt_host_snapshot = self.adoption.adopt_host_snapshot
        self.grow_host = self.host.grow

    # the clock's values, as the index's (tests move ``tick`` on)
    epoch = property(lambda self: self.clock.epoch)
    L = property(lambda self: self.clock.L)
    tick = property(lambda self: self.clock.tick, lambda self, v: setattr(self.clock, "tick", v))

    # ------------------------------------------------------------------ lookup and admission (§6)
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
        self.counters.quotes += 1
        return admission.quote(m, prompt.n, entitlement_pages=entitlement_pages,
                               free_pages=free_pages, total_pages=total_pages,
                               evictable=self.residency.evictable_pages(), cost=self.cost,
                               block_bytes=self.block_bytes, image_bytes=self.image_bytes,
                               epoch=self.clock.epoch)

    def stage(self, quote: Quote, *, free_pages: int) -> Staged:
        """Spec §6.4 steps 1-2: re-validate, pin the path up to F_s and the source, count a hit,
        and evict from the device LRU until the pools hold ``quote.need_pages``."""
        if quote.epoch != self.clock.epoch:
            raise StaleQuote(f"quote at epoch {quote.epoch}, cache now at {self.clock.epoch}")
        if not quote.ready:
            raise ValueError(f"stage of a {quote.readiness.value} quote")
        self.clock.epoch += 1
        self.clock.tick += 1
        seq = self.begin_sequence()
        residency = self.residency
        for node in quote.path:
            residency.pin_node(node)
            seq.nodes.append(node)
            if node.device_state == ABSENT:
                residency.awaiting_restore[node] = None
        s = quote.source
        if s is not None:
            residency.snap_pins(s, +1)
            seq.stage_pin = s
            seq.source = s
            seq.to_supersede = s
            seq.resumed_from_endpoint = s.kind is SnapshotKind.ENDPOINT
            self.lineage.hit(s)
        freed = Freed()
        want = quote.need_pages - free_pages
        if want > 0:
            freed = residency.evict_device(want)
        short = max(0, want - len(freed.pages))
        self.counters.stages += 1
        self.counters.reuse_tokens += quote.reuse_tokens
        return Staged(seq, quote, freed, list(quote.restore_blocks), quote.restore_tail,
                      quote.restore_image, short)

    def begin_restore(self, staged: Staged, block_pages: Iterable[PageBundle] = (),
                      tail_pages: PageBundle | None = None) -> RestoreBatch | None:
        """Spec §6.4 step 3: the host-only blocks adopt ``block_pages`` (one bundle each, in
        path order) and become device Filling; a host-only tail takes ``tail_pages``; a host-only
        image is copied into the lane's own slot. None when nothing is host-only."""
        pages = list(block_pages)
        assert len(pages) == len(staged.restore_blocks), \
            f"{len(staged.restore_blocks)} host-only blocks need pages, got {len(pages)}"
        if not pages and not staged.restore_tail and not staged.restore_image:
            return None
        self.clock.epoch += 1
        return self.transfers.restore(staged, pages, tail_pages)

    def activate(self, staged: Staged) -> SequencePath:
        """The lane is built: it owns the path pins; the stage pin on the source drops."""
        seq = staged.seq
        assert not self.residency.awaiting_restore.keys() & set(staged.restore_blocks), \
            "activate before begin_restore gave the host-only blocks their pages"
        if seq.stage_pin is not None:
            self.residency.snap_pins(seq.stage_pin, -1)
            seq.stage_pin = None
        return seq

    def begin_sequence(self) -> SequencePath:
        """A cache-enabled sequence prefilled from the root without a quote (tests, warm paths)."""
        seq = SequencePath(self._next_seq, [])
        self._next_seq += 1
        self.sequences[seq.id] = seq
        return seq

    # ------------------------------------------------------------------ block commit (§7.6)
    def commit_block(self, seq: SequencePath, tokens: bytes, pages: PageBundle, *,
                     extra: int = 0, h: int | None = None, media: tuple = ()) -> CommitOutcome:
        """Block ``len(seq.nodes)`` committed in every pool, written in the sequence's ``pages``.
        The node stays pinned for the sequence. ``media``: the Vision items its tokens hold
        (``extra`` is their key; kept on a new node for the cache file and inspection)."""
        assert not seq.released, f"commit on released sequence {seq.id}"
        residency, tally = self.residency, self.tally
        residency.check_bundle(pages)
        parent = seq.nodes[-1] if seq.nodes else self.tree.root
        assert parent.alive, f"commit below a deleted node {parent!r}"
        if h is None:
            h = lookup_hash(parent.hash, tokens, extra)
        node = self.tree.child(parent, h, tokens, extra)
        if node is not None and node.device_state != ABSENT:
            outcome = CommitOutcome.DUPLICATE
            seq.duplicate_pages.append(tuple(pages))
            residency.pin_node(node)
        elif node is not None:
            outcome = CommitOutcome.ADOPTED
            tally.count_node(node, -1)
            node.active_refs += 1
            node.device_pages = tuple(pages)
            node.device_state = RESIDENT
            tally.count_node(node, +1)
            residency.relink(node)
            residency.dead.update(node)
        else:
            outcome = CommitOutcome.INSERTED
            node = self.tree.insert(parent, h, tokens, extra)
            node.media = tuple(media)
            node.active_refs = 1
            node.device_pages = tuple(pages)
            node.device_state = RESIDENT
            tally.count_node(node, +1)
            residency.dead.update(parent)
        self.clock.tick += 1
        seq.nodes.append(node)
        self.counters.commits[outcome.value] += 1
        return outcome

    # ------------------------------------------------------------------ publication (§9.2, §7.4, §7.7)
    def acquire_snapshot_slot(self, seq: SequencePath | None, kind: SnapshotKind, frontier: int,
                              tail_len: int | None = None) -> SlotGrant | None:
        """A device snapshot slot for a tap or endpoint at ``frontier`` (:mod:`.slots`, §9.2)."""
        return self.grants.acquire(seq, kind, frontier, tail_len)

    def publish(self, seq: SequencePath, kind: SnapshotKind, frontier: int, *, slot: SnapshotSlot,
                tail_tokens: bytes = b"", tail_pages: PageBundle | None = None,
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
        clock = self.clock
        self.lineage.supersede_lineage(seq, kind, frontier)
        freed = Freed()
        for s in anchor.snapshots:
            if s.tail_tokens == tail_tokens and s.tail_extra == tail_extra:
                clock.tick += 1
                s.last_hit_tick = clock.tick
                if s.superseded:
                    self.lineage.retain(s)
                self.slots.release(slot)
                if tail_pages is not None:
                    freed.pages.append(tuple(tail_pages))
                if kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
                    seq.last_tap = s
                self.counters.publish_duplicates += 1
                return PublishResult(s, True, None, freed)
        clock.tick += 1
        s = Snapshot(self.lineage.mint_id(), anchor, frontier, kind, tail_tokens, tail_extra,
                     device_slot=slot, device_state=RESIDENT, last_hit_tick=clock.tick, l_base=clock.L)
        if tail_pages is not None:
            self.residency.check_bundle(tail_pages)
            s.tail_pages = tuple(tail_pages)
            s.tail_device_state = RESIDENT
        self.slot_owner[slot] = s
        self.tally.count_snapshot(s, +1)
        self.lineage.attach(s)
        self.residency.relink_tail(s)
        if kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
            seq.last_tap = s
        self.counters.published[kind.value] += 1
        write = None
        if write_through and self.host.enabled:
            write = self.transfers.write_snapshot(s, freed)
        return PublishResult(s, False, write, freed)

    def release(self, seq: SequencePath, *, write_through: bool = True) -> Release:
        """Terminal settlement: enqueue write-through of the path's device-only nodes (one batch),
        then active_refs-- in reverse block order so deeper blocks reach the LRU head first."""
        assert not seq.released, f"sequence {seq.id} released twice"
        seq.released = True
        residency, tally = self.residency, self.tally
        if seq.stage_pin is not None:
            residency.snap_pins(seq.stage_pin, -1)
            seq.stage_pin = None
        for node in seq.nodes:
            if node in residency.awaiting_restore:
                raise AssertionError(f"release of sequence {seq.id} before its restore was begun")
        write = None
        freed = Freed()
        if write_through and self.host.enabled:
            write = self.transfers.write_blocks(seq.nodes, freed)
        for node in reversed(seq.nodes):
            tally.count_node(node, -1)
            node.active_refs -= 1
            tally.count_node(node, +1)
            assert node.active_refs >= 0, f"{node!r}: active_refs below zero"
            residency.relink(node)
            residency.dead.update(node)
        del self.sequences[seq.id]
        self.clock.epoch += 1
        pages = seq.duplicate_pages
        seq.duplicate_pages = []
        return Release(pages, write, freed)

    # ------------------------------------------------------------------ host valuation (§9.3)
    def host_victim(self) -> tuple[Snapshot | None, float]:
        """The snapshot host allocation would evict at §9.3 step 3 now, and its H."""
        return gdsf.min_priority(self.snapshots.values(), self.priority)

    # ------------------------------------------------------------------ views
    def check_invariants(self) -> list[set[int]]:
        """Check every invariant (``hpc_cli.cache.invariants``); returns the device pages the
        index owns (blocks and snapshot tails), one set per device pool."""
        from hpc_cli.cache.invariants import check_invariants
        return check_invariants(self)

    def stats(self, *, recount: bool = False) -> IndexStats:
        """The index's counts (:func:`hpc_cli.cache.stats.summary`, O(1)); with ``recount`` every
        count is taken by a full walk instead (tests, debugging)."""
        from hpc_cli.cache import stats
        return stats.stats(self) if recount else stats.summary(self)
