"""Around a lane's prefill passes and decode rounds in the hybrid mode: where a pass must stop
for an exact tap (spec §7.1), the restore's per-layer wait (§6.5), and the commit of every full
block as a cached block of the index (§7.6); the taps it reaches are published by
:mod:`.publish`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from hpc_cli.cache.keys import BLOCK_TOKENS, token_bytes
from hpc_cli.cache.records import CommitOutcome
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.cache.taps import Placement
from hpc_cli.engine.hybrid.parts import BindingParts
from hpc_cli.engine.lane import Lane
from hpc_cli.memory.pools import PageState

if TYPE_CHECKING:
    from hpc_cli.model.model import TapImage


class Commit(BindingParts):
    """Prefill stops, block commits and the taps a pass reaches (mixed into the binding)."""

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
        that the pass does not take itself (it takes one per tap slot, :meth:`pass_taps`)."""
        inside = self._inside(lane, end)
        n = len(self.tap_scratch)
        return inside[n] if len(inside) > n else end

    def pass_taps(self, lane: Lane, end: int) -> list[TapImage]:
        """The exact taps strictly inside the pass ``[lane.pos, end)`` that it takes itself, each
        with the tap slot the pass writes its image into (:meth:`after_pass` snapshots them)."""
        from hpc_cli.model.model import TapImage

        return [TapImage(p, slot) for p, slot in zip(self._inside(lane, end), self.tap_scratch)]

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
