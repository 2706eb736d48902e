"""Snapshots in the hybrid mode: a tap copies the lane's state into a snapshot slot (or takes
over the tap slot a pass wrote its image into, the zero-split tap, spec §7.3), an endpoint freezes the lane's
own image with its partial last page (§7.4, §7.7); either is published to the index and written
through to the host tier. And the lane's terminal settlement (§7.7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_cli.cache.ids import StateSlot
from hpc_cli.cache.keys import BLOCK_TOKENS, token_bytes
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.engine.hybrid.parts import BindingParts
from hpc_cli.engine.lane import Lane
from hpc_cli.memory.pools import PageState

if TYPE_CHECKING:
    from hpc_cli.model.model import TapImage


class Publish(BindingParts):
    """Takes snapshots and settles finished lanes (mixed into the binding)."""

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
            if tail_len:
                page = self._alloc_cache_page()
                if page is None:
                    self.index.release_snapshot_slot(k)
                    self.counters["taps_skipped"] += 1
                    return False
                self._copy_page(lane.pages[d], page, tail_len)
                tail_pages = (page,)
            if image is not None:  # the image's slot becomes the snapshot's; its old slot a tap slot
                slot = StateSlot(image.slot)
                j = self.tap_scratch.index(slot)
                self.tap_scratch[j], self.snap_phys[k] = self.snap_phys[k], slot
                self.counters["taps_in_pass"] += 1
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
            # making host room for the write-through may have deleted snapshots whose tails held
            # device pages: they go back to the pool here (left out, each was lost for good)
            self._free_pages(rel.freed.pages)
            self._write(rel.write)
            lane.seq = None
            if self.shared is not None:  # land what already finished now: the shared tier then has
                self.poll()  # the turn's entries before its answer reaches the client
        self._free_pages([(p,) for p, own in zip(lane.pages, lane.owned) if own])
        lane.pages, lane.owned = [], []
        if lane.state_slot >= 0:
            self.free_active.append(lane.state_slot)
            lane.state_slot = StateSlot(-1)
