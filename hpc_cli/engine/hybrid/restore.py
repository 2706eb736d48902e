"""Admission of a lane in the hybrid mode (spec §6.1-6.6): quote, stage, restore from the host
tier, activate; or wait: a blocked head is prefetched (§6.6), a head sharing a prefilling lane's
prefix coalesces (§12.2). Disabled requests and ``reuse=False`` get private pages and a reset
state."""

from __future__ import annotations

import time

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.records import Readiness, StaleQuote
from hpc_cli.cache.taps import Placement, Tap, TapHint as PlannerHint, TapSource
from hpc_cli.engine.api import TapHint
from hpc_cli.engine.binding import Admission, Blocked, admissible_pages, entitlement, start_from_root
from hpc_cli.engine.hybrid.parts import BindingParts
from hpc_cli.engine.lane import Lane
from hpc_cli.errors import EngineError
from hpc_cli.memory.pools import PageState
from hpc_cli.memory.transfer.records import RestoreBatch as CopyBatch

HINT_SOURCE = {1: TapSource.EXPLICIT, 2: TapSource.OPENER, 3: TapSource.STRUCTURAL}


def planner_hints(hints: list[TapHint], boundaries: list[int]) -> list[PlannerHint]:
    out = [PlannerHint(h.position, TapSource.AUTOMATIC if h.automatic else HINT_SOURCE.get(h.priority, TapSource.STRUCTURAL))
           for h in hints]
    out += [PlannerHint(b, TapSource.MESSAGE) for b in boundaries]
    return out


def common_prefix(a: Lane, b: Lane) -> int:
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


class Restore(BindingParts):
    """Admits lanes and prefetches the blocked head's path (mixed into the binding)."""

    def admit(self, lane: Lane, siblings: list[Lane] = ()) -> Admission:
        """Quote, stage, restore and activate ``lane``; raises :class:`Blocked` to wait.
        ``siblings``: lanes still prefilling, for in-flight coalescing (spec §12.2)."""
        self.settle_prefetch()
        self.poll()
        ent = admissible_pages(lane, len(self.free_active), self.pool.num_pages)
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
        hints = planner_hints(lane.request.tap_hints, lane.request.message_boundaries)
        if q.cached_prefix_tokens - q.reuse_tokens >= BLOCK_TOKENS:
            # the prompt leaves a cached path whose state is not kept where it leaves (another
            # prompt's blocks went on from there, or its snapshot is gone): tap it there, so that
            # the next prompt sharing this prefix resumes from it (spec §12.2's target, between
            # requests rather than beside a sibling still prefilling)
            hints.append(PlannerHint(q.cached_prefix_tokens, TapSource.DIVERGENCE))
        lane.taps = self.planner.plan(lane.n_prompt, lane.pos, hints,
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
            d = common_prefix(lane, sib)
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
        ent = entitlement(lane.n_prompt, lane.max_tokens)
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
        start_from_root(lane, self.pool.alloc(ent, PageState.ACTIVE), self.free_active.pop(), self.states)
        return Admission(0, 0, 0)
