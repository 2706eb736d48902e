"""The hybrid binding: the prefix index, the device pools, the host tier and the transfer engine
working for the engine's lanes (spec §6.4-6.5, §7.4-7.7, §9.1; ARCHITECTURE.md §4).

The engine calls, in a request's order: :meth:`admit` (quote, stage, restore, activate; or
wait: a blocked head is prefetched, a head sharing a prefilling lane's prefix coalesces),
:meth:`before_pass` / :meth:`after_pass` around every prefill pass (block commit, taps),
:meth:`commit_blocks` after decode rounds, :meth:`finish` at terminal settlement (endpoint
snapshot, release, write-through), and :meth:`poll` to land transfers (the contract:
:mod:`hpc_cli.engine.binding`; cache mode ``off`` is :mod:`hpc_cli.engine.off`). With ``reuse=False`` and for disabled requests nothing is
matched, committed or published: lanes get private pages and a reset state.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Sequence

from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import CacheGeometry, CommitOutcome, Readiness, StaleQuote
from hpc_cli.cache.keys import BLOCK_TOKENS, token_bytes
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.cache.stats import snapshot_rows
from hpc_cli.cache.taps import Placement, Tap, TapHint as PlannerHint, TapPlanner, TapSource
from hpc_cli.engine.api import TapHint
from hpc_cli.engine.binding import Admission, Blocked, Residency
from hpc_cli.engine.lane import Lane
from hpc_cli.errors import EngineError
from hpc_cli.memory.host_slabs import BundleLayout, HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool, PageState
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.records import RestoreBatch as CopyBatch

if TYPE_CHECKING:
    from hpc_cli.model.model import TapImage
    from hpc_cli.engine.shared import SharedTier

_HINT_SOURCE = {1: TapSource.EXPLICIT, 2: TapSource.OPENER, 3: TapSource.STRUCTURAL}


def planner_hints(hints: list[TapHint], boundaries: list[int]) -> list[PlannerHint]:
    out = [PlannerHint(h.position, TapSource.AUTOMATIC if h.automatic else _HINT_SOURCE.get(h.priority, TapSource.STRUCTURAL))
           for h in hints]
    out += [PlannerHint(b, TapSource.MESSAGE) for b in boundaries]
    return out


def _common_prefix(a: Lane, b: Lane) -> int:
    """Tokens the two prompts share: whole blocks by their chained hashes, then token by token
    inside the first block that differs. Only the coalescing decision uses this (a collision
    would cost a wait, never a wrong reuse: the index matches tokens exactly)."""
    if a.prepared.salt != b.prepared.salt:
        return 0  # different tenants (docs/security.md): nothing to share, nothing to wait for
    if a.prepared.media or b.prepared.media:
        return 0  # Vision prompts do not coalesce (spec §12.2): placeholders are equal for any image
    ha, hb = a.prepared.hashes, b.prepared.hashes
    blocks = 0
    for x, y in zip(ha, hb):
        if x != y:
            break
        blocks += 1
    n = BLOCK_TOKENS * blocks
    limit = min(a.n_prompt, b.n_prompt)
    ta, tb = a.tokens, b.tokens
    while n < limit and ta[n] == tb[n]:
        n += 1
    return n


class HybridBinding:
    mode = "hybrid"
    persistent = True  # the prefix cache file (spec §5.5) loads into and saves from its host tier
    #: how long construction waits for the host tier's first chunk (allocation is lazy on the
    #: CPU, so it is there at once; a pinned 4 GiB chunk takes ~1.5 s on an H200 and joins later)
    FIRST_CHUNK_WAIT_S = 0.1

    def __init__(self, model: Any, storage: Any, states: Any, *, lanes: int, snapshot_slots: int,
                 host_bytes: int, reuse: bool, planner: TapPlanner, transfer_factory=None,
                 coalesce: bool = False, coalesce_wait_limit: float = 300.0,
                 backend_storage: Any = None, frontier_lag: int = 0, in_pass_taps: int = 0) -> None:
        self.model = model
        #: how many exact taps a prefill pass takes itself (:meth:`pass_taps`, no split) before one
        #: ends the pass there (the mode sets the model's capacity, 0 with a speculative backend,
        #: whose state parts a pass does not tap)
        self.in_pass_taps = in_pass_taps
        self.storage = storage
        # a speculative backend's own pool (DFlash: same page ids as the main pool) and how far its
        # committed frontier may trail the text frontier (MTP: 1; lane.backend_frontier is exact)
        self.backend_storage = backend_storage
        self.frontier_lag = frontier_lag
        self.states = states
        self.reuse = reuse
        self.planner = planner
        self.coalesce = coalesce and reuse
        self.coalesce_wait_limit = coalesce_wait_limit  # seconds: half the queue timeout
        self._prefetch = None  # the open prefetch's ticket (one at a time)
        self._prefetch_last: tuple[str, int] | None = None
        self.C = lanes
        self.D = snapshot_slots if reuse else 0
        self.layout = BundleLayout.for_storage(storage, backend_storage)
        slab = self.layout.slab_bytes
        image_bytes = states.image_bytes
        num_slabs = host_bytes // slab if (reuse and host_bytes) else 0
        # the host tier is allocated and pinned in the background, first chunk first (§5.4);
        # the slabs of each chunk join the index at the first poll() after it is ready (the
        # engine sets host.on_ready to wake its worker for that)
        self.host = HostSlabStorage(slab, num_slabs, background=True)
        self.host.wait_ready(self.host.slabs_per_chunk, timeout=self.FIRST_CHUNK_WAIT_S)
        self.index = PrefixIndex(CacheGeometry(block_bytes=self.layout.record_bytes, image_bytes=image_bytes,
                                               device_snapshot_slots=self.D, host_bytes=num_slabs * slab,
                                               slab_bytes=slab), host_ready_slabs=self.host.ready_slabs)
        self.pool = DeviceKVPool(storage, evictable=self.index.evictable_pages)
        make = transfer_factory or TransferEngine
        from hpc_cli.memory.transfer.plan import layer_order_for_shape

        self.transfer = make(storage, self.host, state=states, layer_order=layer_order_for_shape(model.shape()),
                             **({"backend": backend_storage} if backend_storage is not None else {}))
        self.free_active = list(range(lanes - 1, -1, -1))
        self.snap_phys = [lanes + k for k in range(self.D)]  # index snapshot slot -> state slot
        self.jobs: dict[int, tuple[str, Any]] = {}  # transfer job id -> (kind, index batch)
        self.failed: str | None = None
        self.counters = {"restored_host_bytes": 0, "taps": 0, "taps_skipped": 0, "endpoints": 0,
                         "transfer_failures": 0, "blocked": 0, "coalesce_waits": 0,
                         "prefetched_blocks": 0, "prefetched_bytes": 0}
        self.shared: "SharedTier | None" = None  # the shared tier (L3), hpc_cli.engine.shared

    # ------------------------------------------------------------------ sizes
    @property
    def image_bytes(self) -> int:
        return self.states.image_bytes

    def entitlement(self, n_prompt: int, max_tokens: int) -> int:
        return max(1, math.ceil((n_prompt + max_tokens) / BLOCK_TOKENS))

    # ------------------------------------------------------------------ admission (§6.1-6.5)
    def admit(self, lane: Lane, siblings: list[Lane] = ()) -> Admission:
        """Quote, stage, restore and activate ``lane``; raises :class:`Blocked` to wait.
        ``siblings``: lanes still prefilling, for in-flight coalescing (spec §12.2)."""
        self.settle_prefetch()
        self.poll()
        if not self.free_active:
            raise Blocked("no free lane")
        ent = self.entitlement(lane.n_prompt, lane.max_tokens)
        if ent > self.pool.num_pages:
            raise EngineError(f"the request needs {ent} KV pages ({lane.n_prompt} prompt + {lane.max_tokens} "
                              f"output tokens), the device pool holds {self.pool.num_pages}",
                              hint="lower max_tokens or the prompt, or raise engine.kv_capacity")
        if not (self.reuse and lane.request.cache_enabled):
            return self._admit_plain(lane, ent)
        if lane.request.sampling.prompt_logprobs:
            # Every prompt position needs its logits, so nothing is resumed; the blocks and taps
            # it computes are still published for others.
            adm = self._admit_plain(lane, ent)
            lane.seq = self.index.begin_sequence()
            lane.taps = self.planner.plan(lane.n_prompt, 0, planner_hints(lane.request.tap_hints,
                                                                          lane.request.message_boundaries),
                                          vision_spans=lane.prepared.vision_spans)
            return adm
        if self.shared is not None:  # L3: look up what the device and host tiers lack (may wait)
            self.shared.before_admit(lane)
        for _ in range(3):
            q = self.index.quote(lane.prepared, entitlement_pages=ent, free_pages=self.pool.num_free,
                                 total_pages=self.pool.num_pages)
            if q.readiness is Readiness.PERMANENTLY_INFEASIBLE:
                raise EngineError(f"the request needs {ent} KV pages, more than the device pool holds",
                                  hint="lower max_tokens or raise engine.kv_capacity")
            if q.readiness is Readiness.TEMPORARILY_BLOCKED:
                self.counters["blocked"] += 1
                raise Blocked("pages held by active lanes")
            if self.coalesce and siblings and self._await_sibling(lane, q.reuse_tokens, siblings):
                self.counters["coalesce_waits"] += 1
                raise Blocked("waiting for a sibling's snapshot at the divergence")
            try:
                staged = self.index.stage(q, free_pages=self.pool.num_free)
            except StaleQuote:
                continue
            break
        else:  # pragma: no cover - the worker is the only mutator, so quotes stay fresh
            raise Blocked("quote kept going stale")
        self._free_pages(staged.freed.pages)
        d = len(q.path)
        private = ent - d
        need = len(staged.restore_blocks) + (1 if staged.restore_tail else 0) + private
        assert need <= self.pool.num_free, \
            f"stage left {self.pool.num_free} free pages, {need} needed (short {staged.short_pages})"
        fill = self.pool.alloc(len(staged.restore_blocks), PageState.FILLING)
        tail_page = self.pool.alloc(1, PageState.FILLING)[0] if staged.restore_tail else None
        batch = self.index.begin_restore(staged, [(p,) for p in fill],
                                         (tail_page,) if tail_page is not None else None)
        slot = self.free_active.pop()
        lane.state_slot = slot
        s = q.source
        if batch is not None:
            copy = CopyBatch(
                blocks=[(bt.pages[0], bt.slab) for bt in batch.blocks],
                tail=((batch.snapshot.tail_pages[0], batch.snapshot.tail_slab)
                      if batch.snapshot is not None and batch.snapshot.tail_pages is not None else None),
                image=(slot, list(batch.snapshot.slabs)) if batch.restore_image else None)
            ticket = self.transfer.restore(copy)
            self.jobs[ticket.job_id] = ("restore", batch)
            lane.ticket = ticket
            lane.restore_batch = batch
            lane.usage.restored_host_bytes = ticket.nbytes
            self.counters["restored_host_bytes"] += ticket.nbytes
        seq = self.index.activate(staged)
        lane.seq = seq
        lane.pages = [n.device_pages[0] for n in seq.nodes]
        lane.owned = [False] * d
        own = self.pool.alloc(private, PageState.ACTIVE)
        lane.pages += own
        lane.owned += [True] * private
        # The state: from the root, from the snapshot's device slot, or restored in place.
        if s is None:
            self.states.reset(slot)
        else:
            if lane.ticket is not None:
                lane.ticket.wait_prelude()
            if not (batch is not None and batch.restore_image):
                self.states.copy_slot(self.snap_phys[s.device_slot], slot)
            tail_len = s.frontier - BLOCK_TOKENS * d
            if tail_len:
                self._copy_page(s.tail_pages[0], lane.pages[d], tail_len)
        lane.pos = q.reuse_tokens
        lane.taps = self.planner.plan(lane.n_prompt, lane.pos,
                                      planner_hints(lane.request.tap_hints, lane.request.message_boundaries),
                                      existing=[x.frontier for x in q.match.candidates],
                                      vision_spans=lane.prepared.vision_spans,
                                      resumed_from_endpoint=seq.resumed_from_endpoint)
        return Admission(q.reuse_tokens, q.cached_prefix_tokens, lane.usage.restored_host_bytes)

    def _await_sibling(self, lane: Lane, reuse: int, siblings: list[Lane]) -> bool:
        """In-flight prefix coalescing (spec §12.2): when a lane still prefilling shares more of
        this prompt than the cache can serve now, plant an exact Boundary tap at the block
        boundary below the divergence in the sibling's plan and wait for it to publish. It waits
        only when the prefill it saves exceeds the split it may add (one chunk's fixed cost) and
        twice the sibling's predicted prefill up to the target fits in half the queue timeout."""
        cost = self.index.cost
        best = None
        for sib in siblings:
            if sib.seq is None or sib is lane:
                continue
            d = _common_prefix(lane, sib)
            target = min(d - d % BLOCK_TOKENS, lane.n_prompt - 1)
            if target <= max(reuse, sib.pos - 1) or target <= reuse + BLOCK_TOKENS:
                continue  # the sibling passed it, or it saves less than a block
            # Wait only when the prefill saved exceeds the split the target may add to the sibling.
            if cost.prefill_seconds(reuse, target - reuse) <= cost.chunk_seconds:
                continue
            wait = cost.prefill_seconds(sib.pos, target - sib.pos)
            if 2 * wait > self.coalesce_wait_limit:
                continue
            if best is None or target > best[1]:
                best = (sib, target)
        if best is None:
            return False
        sib, target = best
        if not any(t.position == target for t in sib.taps):
            sib.taps = sorted(sib.taps + [Tap(target, Placement.EXACT, TapSource.EXPLICIT, True)],
                              key=lambda t: t.position)
        return True

    def prefetch(self, lane: Lane, limit: int = 256) -> int:
        """Spec §6.6: while ``lane`` (the FIFO head) stays blocked, copy up to ``limit`` of its
        host-only path blocks into spare device pages: free pages first, then host-backed cached
        blocks least recently used first (never a last copy, never the head's own path). The
        blocks land as ordinary cached blocks; admission then restores only the rest. Retried for
        the same head only while the last attempt copied blocks or the spare room grew."""
        if self.shared is not None:
            self.shared.start_lookup(lane)  # the shared tier's lookup runs while the head waits
        if not (self.reuse and lane.request.cache_enabled and self.host.num_slabs) or self._prefetch is not None:
            return 0
        room = self.pool.num_free + len(self.index.lru_backed)
        key = (lane.request.request_id, room)
        if self._prefetch_last == key:
            return 0
        self._prefetch_last = key
        ent = self.entitlement(lane.n_prompt, lane.max_tokens)
        q = self.index.quote(lane.prepared, entitlement_pages=ent, free_pages=self.pool.num_free,
                             total_pages=self.pool.num_pages)
        nodes = self.index.prefetch_candidates(q, limit)
        if not nodes:
            return 0
        if self.pool.num_free < len(nodes):
            self._free_pages(self.index.evict_backed(len(nodes) - self.pool.num_free, keep=q.match.path).pages)
        nodes = nodes[:self.pool.num_free]
        if not nodes:
            return 0
        pages = self.pool.alloc(len(nodes), PageState.FILLING)
        batch = self.index.begin_prefetch(nodes, [(p,) for p in pages])
        ticket = self.transfer.restore(CopyBatch(blocks=[(bt.pages[0], bt.slab) for bt in batch.blocks]))
        self.jobs[ticket.job_id] = ("restore", batch)
        self._prefetch = ticket
        self.counters["prefetched_blocks"] += len(nodes)
        self.counters["prefetched_bytes"] += ticket.nbytes
        self._prefetch_last = (lane.request.request_id, -1)  # copied something: may retry
        return len(nodes)

    def settle_prefetch(self) -> None:
        """A quote whose candidates cross a landing prefetch waits for it rather than skipping
        them for a shallower source (spec §6.6)."""
        deadline = time.monotonic() + 30.0
        while self._prefetch is not None and time.monotonic() < deadline:
            self.poll()
            if self._prefetch is not None:
                time.sleep(0.0005)

    def _admit_plain(self, lane: Lane, ent: int) -> Admission:
        if ent > self.pool.available:
            self.counters["blocked"] += 1
            raise Blocked("pages held by active lanes")
        if ent > self.pool.num_free:
            self._free_pages(self.index.evict_device(ent - self.pool.num_free).pages)
        lane.pages = self.pool.alloc(ent, PageState.ACTIVE)
        lane.owned = [True] * ent
        lane.state_slot = self.free_active.pop()
        self.states.reset(lane.state_slot)
        lane.pos = 0
        lane.taps = []
        return Admission(0, 0, 0)

    # ------------------------------------------------------------------ prefill support
    def layer_ready(self, lane: Lane):
        """The first prefill pass waits for the restore's per-layer events (spec §6.5)."""
        ticket = lane.ticket
        if ticket is None:
            return None
        lane.ticket = None
        return ticket.wait_layer

    def _inside(self, lane: Lane, end: int) -> list[int]:
        return [t.position for t in lane.taps if t.placement is Placement.EXACT and lane.pos < t.position < end]

    def next_stop(self, lane: Lane, end: int) -> int:
        """Where the next prefill pass must end: at ``end``, or at the first exact tap inside it
        that the pass does not take itself (it takes up to ``in_pass_taps``, :meth:`pass_taps`)."""
        inside = self._inside(lane, end)
        return inside[self.in_pass_taps] if len(inside) > self.in_pass_taps else end

    def pass_taps(self, lane: Lane, end: int) -> list[int]:
        """The exact taps strictly inside the pass ``[lane.pos, end)`` that it takes itself (the
        model returns their images; :meth:`after_pass` snapshots them)."""
        return self._inside(lane, end)[:self.in_pass_taps]

    def before_pass(self, lane: Lane, end: int) -> None:
        """Flexible taps inside the prompt's final chunk are taken at that chunk's start (§7.1)."""
        if end < lane.n_prompt or not lane.taps:
            return
        inside = [t for t in lane.taps if t.placement is Placement.FLEXIBLE]
        if not inside:
            return
        lane.taps = [t for t in lane.taps if t.placement is not Placement.FLEXIBLE]
        if lane.pos > self._deepest(lane):
            self.take_snapshot(lane, SnapshotKind.TAP)

    def after_pass(self, lane: Lane, tapped: Sequence[TapImage] = ()) -> None:
        """Commit every block the lane completed, then take the taps the pass reached: the images
        the pass took inside it (``tapped``, in order), then a tap at its end (an exact tap ends
        its pass where the pass does not take it itself, spec §7.1; flexible taps are taken at
        the chunk end)."""
        self.commit_blocks(lane)
        if tapped:
            boundary = {t.position for t in lane.taps if t.boundary}
            for image in tapped:
                if image.position > self._deepest(lane):
                    kind = SnapshotKind.BOUNDARY if image.position in boundary else SnapshotKind.TAP
                    self.take_snapshot(lane, kind, image=image)
        due = [t for t in lane.taps if t.position <= lane.pos]
        if not due:
            return
        lane.taps = [t for t in lane.taps if t.position > lane.pos]
        due = [t for t in due if t.position == lane.pos or t.placement is Placement.FLEXIBLE]  # the rest: in the pass
        if not due or lane.pos >= lane.n_prompt or lane.pos <= self._deepest(lane):
            return
        kind = SnapshotKind.BOUNDARY if any(t.boundary for t in due) else SnapshotKind.TAP
        self.take_snapshot(lane, kind)

    def _deepest(self, lane: Lane) -> int:
        seq = lane.seq
        if seq is None:
            return 0
        return max((s.frontier for s in (seq.source, seq.last_tap) if s is not None and s.alive), default=0)

    def committed_frontier(self, lane: Lane) -> int:
        """Tokens every pool has committed (spec §7.6): the text frontier, or a speculative
        backend's own frontier where it trails (MTP K/V one token behind until the next token is
        known). Rejected draft columns never count: lane.pos holds accepted tokens only."""
        f = lane.pos
        if self.frontier_lag or self.backend_storage is not None:
            bf = getattr(lane, "backend_frontier", None)
            if bf is not None:
                f = min(f, bf)
        return f

    def _copy_page(self, src: int, dst: int, n_tokens: int) -> None:
        self.storage.copy_page(src, dst, n_tokens)
        if self.backend_storage is not None:
            self.backend_storage.copy_page(src, dst, n_tokens)

    def commit_blocks(self, lane: Lane) -> None:
        seq = lane.seq
        if seq is None:
            return
        prompt = lane.prepared
        frontier = self.committed_frontier(lane)
        while BLOCK_TOKENS * (len(seq.nodes) + 1) <= frontier:
            b = len(seq.nodes)
            if b < len(prompt.blocks):
                tb, h, extra = prompt.blocks[b], prompt.hashes[b], prompt.extras[b]
            else:  # a generated block: its parent chain already carries the prompt's salt (and
                # the prompt's images it holds, if it begins inside the prompt, key it)
                tb, h, extra = (token_bytes(lane.tokens[BLOCK_TOKENS * b:BLOCK_TOKENS * (b + 1)]), None,
                                prompt.block_extra(b))
            page = lane.pages[b]
            outcome = self.index.commit_block(seq, tb, (page,), extra=extra, h=h,
                                              media=prompt.block_media(b) if prompt.media else ())
            if outcome is not CommitOutcome.DUPLICATE:
                lane.owned[b] = False
                self.pool.set_state([page], PageState.CACHED)

    def take_snapshot(self, lane: Lane, kind: SnapshotKind, *, endpoint: bool = False,
                      image: TapImage | None = None) -> bool:
        """Snapshot the lane's state at ``lane.pos`` (a tap: a copy; an endpoint: the active
        image itself and the partial last page as the tail, spec §7.4, §7.7), or the ``image`` a
        prefill pass took inside it at ``image.position`` (the zero-split tap, spec §7.3)."""
        seq = lane.seq
        p = lane.pos if image is None else image.position
        if seq is None or p == 0:
            return False
        if p < BLOCK_TOKENS and lane.prepared.salt:
            return False  # anchored at the root, it would carry no salt (hpc_cli.cache.keys)
        if lane.prepared.inside_vision(p):
            return False  # never a resume point inside an image (a prefill cancelled there)
        d, tail_len = divmod(p, BLOCK_TOKENS)
        if len(seq.nodes) < d and self.committed_frontier(lane) < p:
            # a speculative backend has not committed the anchoring block yet (MTP whose next
            # token is unknown at a page-aligned frontier): skip, never publish uncommitted KV
            self.counters["taps_skipped"] += 1
            return False
        assert len(seq.nodes) >= d, f"snapshot at {p}: only {len(seq.nodes)} blocks committed"
        grant = self.index.acquire_snapshot_slot(seq, kind, p, tail_len)
        if grant is None:
            self.counters["taps_skipped"] += 1
            return False
        self._free_pages(grant.freed.pages)
        k = grant.slot
        tail_pages = None
        if endpoint:
            phys = self.snap_phys[k]
            self.snap_phys[k] = lane.state_slot
            lane.state_slot = phys  # the lane keeps a slot to return; the image is frozen as is
            if tail_len:
                tail_pages = (lane.pages[d],)
                lane.owned[d] = False
                self.pool.set_state(tail_pages, PageState.CACHED)
        else:
            if image is None:
                self.states.copy_slot(lane.state_slot, self.snap_phys[k])
            else:
                self.states.write_image(self.snap_phys[k], image.conv, image.recurrent, image.hidden)
            if tail_len:
                page = self._alloc_cache_page()
                if page is None:
                    self.index.release_snapshot_slot(k)
                    self.counters["taps_skipped"] += 1
                    return False
                self._copy_page(lane.pages[d], page, tail_len)
                tail_pages = (page,)
        tail_tokens = token_bytes(lane.tokens[BLOCK_TOKENS * d:p]) if tail_len else b""
        tail_extra = lane.prepared.tail_extra(BLOCK_TOKENS * d, p) if tail_len else 0  # its images
        pr = self.index.publish(seq, kind, p, slot=k, tail_tokens=tail_tokens, tail_pages=tail_pages,
                                tail_extra=tail_extra)
        self._free_pages(pr.freed.pages)
        self._write(pr.write)
        self.counters["endpoints" if endpoint else "taps"] += 1
        return True

    def _alloc_cache_page(self) -> int | None:
        if self.pool.num_free == 0:
            self._free_pages(self.index.evict_device(1).pages)
        got = self.pool.try_alloc(1, PageState.CACHED)
        return got[0] if got else None

    # ------------------------------------------------------------------ finish (§7.7)
    def finish(self, lane: Lane, *, publish: bool = True) -> None:
        """Terminal settlement: endpoint snapshot, release with write-through, free the rest."""
        if lane.ticket is not None:  # released before its first pass: the slot may be a destination
            lane.ticket.wait_all()
            lane.ticket = None
        seq = lane.seq
        if seq is not None:
            if publish and self.failed is None:
                self.commit_blocks(lane)
                if lane.pos - self._deepest(lane) >= BLOCK_TOKENS and lane.pos >= 1:
                    self.take_snapshot(lane, SnapshotKind.ENDPOINT, endpoint=True)
            rel = self.index.release(seq, write_through=self.failed is None)
            self._write(rel.write)
            lane.seq = None
            if self.shared is not None:  # land what already finished now: the shared tier then has
                self.poll()  # the turn's entries before its answer reaches the client
        self._free_pages([(p,) for p, own in zip(lane.pages, lane.owned) if own])
        lane.pages, lane.owned = [], []
        if lane.state_slot >= 0:
            self.free_active.append(lane.state_slot)
            lane.state_slot = -1

    # ------------------------------------------------------------------ transfers
    def _write(self, batch) -> None:
        if batch is None or not batch:
            return
        job = self.transfer.write_through(
            blocks=[(bt.pages[0], bt.slab) for bt in batch.blocks],
            images=[(self.snap_phys[st.slot], list(st.slabs)) for st in batch.snapshots],
            tails=[(st.tail_pages[0], st.tail_slab) for st in batch.snapshots if st.tail_pages is not None])
        self.jobs[job.job_id] = ("write", batch)

    def grow_host(self) -> int:
        """Hand the index the host slabs whose chunks finished pinning since the last call
        (O(1) when none did). Returns how many were added."""
        ready = self.host.ready_slabs
        if ready == self.index.host.ready_slabs:
            return 0
        return self.index.grow_host(ready)

    def wait_host(self, slabs: int, timeout: float | None = None) -> int:
        """Wait for ``slabs`` host slabs to be ready (or the allocation to stop short), hand them
        to the index and return how many are ready (the cache file load before start)."""
        ready = self.host.wait_ready(slabs, timeout)
        self.grow_host()
        return ready

    @property
    def transfers_pending(self) -> int:
        """Copies enqueued and not yet landed (the worker polls only while some are)."""
        return self.transfer.pending

    def poll(self, completions=None) -> None:
        """Land finished transfers (spec §10.9: residency changes only here or at commit); pick
        up host chunks that became ready."""
        self.grow_host()
        for c in (self.transfer.poll() if completions is None else completions):
            kind, batch = self.jobs.pop(c.job_id)
            if self._prefetch is not None and self._prefetch.job_id == c.job_id:
                self._prefetch = None
            if not c.ok:
                self.counters["transfer_failures"] += 1
                self.failed = f"{kind} transfer {c.job_id} failed: {c.error}"
                self._abandon(kind, batch)
                continue
            if kind == "restore":
                self.index.land_restore(batch)
                self.pool.land([bt.pages[0] for bt in batch.blocks])
                if batch.snapshot is not None and batch.snapshot.tail_pages is not None:
                    self.pool.land([batch.snapshot.tail_pages[0]])
            else:
                self.index.land_write(batch)
                if self.shared is not None:
                    self.shared.written(batch)  # write-behind to the shared tier, once per key

    def _abandon(self, kind: str, batch) -> None:
        """A failed transfer: land it so its pins drop, then drop the copies it was making."""
        if kind == "restore":
            self.index.land_restore(batch)
            self.pool.land([bt.pages[0] for bt in batch.blocks])
            if batch.snapshot is not None and batch.snapshot.tail_pages is not None:
                self.pool.land([batch.snapshot.tail_pages[0]])
        else:
            self.index.land_write(batch)

    def drain(self) -> None:
        # TransferEngine.drain retires the jobs and returns their completions: land those
        # (a poll() after it finds nothing, which left pins and Filling host copies behind).
        self.poll(self.transfer.drain())
        self.poll()

    def _free_pages(self, bundles) -> None:
        pages = [b[0] for b in bundles]
        if pages:
            self.pool.free(pages, abandon_filling=True)

    # ------------------------------------------------------------------ checks and stats
    def check_invariants(self) -> None:
        self.index.check_invariants()
        self.pool.check_invariants()

    def stats(self, *, detailed: bool = False) -> dict[str, Any]:
        """The cache's stats from running counts (O(1): the worker publishes them a few times a
        second and /metrics exports them). ``detailed`` adds what takes a walk, the snapshot
        table (``top_snapshots``): only for a client's request, served by the worker."""
        t = self.index.tally
        out = {"index": self.index.stats(), "pool": self.pool.counts(), "pages": self.pool.num_pages,
               "snapshot_slots": self.D, "lanes_free": len(self.free_active),
               "host_slabs": self.host.num_slabs, "slab_bytes": self.host.slab_bytes,
               "host_tier": self.host.progress().as_dict(),
               "page_bytes": self.storage.page_bytes, "image_bytes": self.image_bytes,
               "transfers_pending": self.transfer.pending,
               "inflight": {"restore_bytes": t.restore_bytes, "write_bytes": t.write_bytes},
               **self.counters}
        if self.shared is not None:
            out["shared"] = self.shared.stats()
        out["residency"] = self.residency().as_dict()
        if detailed:
            out["top_snapshots"] = snapshot_rows(self.index, 16)
        return out

    def residency(self) -> Residency:
        """Bytes held on the device (cached blocks, snapshot images) and the host, and the
        snapshots alive (running counts)."""
        doc = self.index.stats()
        dev, host = doc["device"], doc["host"]
        return Residency(device_kv_bytes=dev["block_bytes_cached"], device_state_bytes=dev["image_bytes_cached"],
                         host_bytes=(host["ready_slabs"] - host["free_slabs"]) * host["slab_bytes"],
                         entries=doc["snapshots"]["total"])

    def leftovers(self) -> dict[str, int]:
        """What is still held (all zero once the engine stopped): pins, sequences, active and
        filling pages, restore pins of snapshots, lanes out, transfers in flight."""
        st, counts = self.index.stats(), self.pool.counts()
        return {"pinned_nodes": st["nodes"]["pinned"], "sequences": st["sequences"],
                "filling_nodes": sum(st["nodes"]["filling"].values()), "active_pages": counts["active"],
                "filling_pages": counts["filling"], "lanes_out": self.C - len(set(self.free_active)),
                "snapshot_restore_pins": sum(s.restore_pins for s in self.index.snapshots.values()),
                "transfers_pending": self.transfer.pending}
