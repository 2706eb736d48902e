"""Supersession and the snapshots' lineage (spec §5.3, §9.3).

:class:`Lineage` is the table of live snapshots and what GDSF reads off their relations: each
snapshot's nearest ancestor on its path and its dependents, the retained (not superseded)
count and id-XOR on every node above a snapshot (so the sole retained owner of a path node is
known in O(1): :func:`hpc_cli.cache.gdsf.exclusive_path_bytes`), and the queue of superseded
snapshots, oldest first, that slot grants (§9.2 step 2) and host eviction (§9.3 step 2) take
from. A snapshot is superseded when its sequence moves on past it (a later tap or endpoint of
the same lineage); only a retry or an edit that diverges before its successor can still use
it. A hit retains it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.stats import Counters
from hpc_cli.cache.tree import BlockNode

if TYPE_CHECKING:
    from hpc_cli.cache.records import Clock, SequencePath
    from hpc_cli.cache.residency import DeadKv


class Lineage:
    """Live snapshots by id, their ancestry, retained counts and the supersession queue."""

    def __init__(self, dead: DeadKv, clock: Clock, counters: Counters) -> None:
        self.snapshots: dict[int, Snapshot] = {}
        self.top: dict[Snapshot, None] = {}  # snapshots with no snapshot above them
        self.superseded: dict[Snapshot, None] = {}  # in supersession order
        self.dead = dead
        self.clock = clock
        self.counters = counters
        self._next_id = 1

    def mint_id(self) -> int:
        sid = self._next_id
        self._next_id += 1
        return sid

    # ------------------------------------------------------------------ attach and detach
    def attach(self, s: Snapshot) -> None:
        """Register a new snapshot on its anchor: live_snapshots_below and the retained counts
        along its path (dead KV below it comes back to life), then its nearest ancestor."""
        anchor = s.anchor
        self.snapshots[s.id] = s
        anchor.snapshots.append(s)
        n = anchor
        sid = s.id
        dead = self.dead.nodes
        while n.parent is not None:
            n.live_snapshots_below += 1
            if n.live_snapshots_below == 1 and n in dead:
                del dead[n]
            n.retained_below += 1
            n.retained_xor ^= sid
            if n.retained_below == 2:
                other = self.snapshots.get(n.retained_xor ^ sid)
                if other is not None:
                    other.dirty = True
            n = n.parent
        self._link_ancestor(s)

    def detach(self, s: Snapshot) -> None:
        """Unregister a deleted snapshot: the counts along its path (a node left with no
        snapshot below may become dead KV), its dependents go to its ancestor."""
        s.anchor.snapshots.remove(s)
        if s.superseded:
            del self.superseded[s]
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
                self.dead.update(n)
            n = n.parent
        # hand dependents to the ancestor
        anc = s.ancestor
        up = anc.dependents if anc is not None else self.top
        del up[s]
        for d in s.dependents:
            d.ancestor = anc
            up[d] = None
            d.dirty = True
            if d.superseded:
                self.dirty_dependents(d)
        s.dependents.clear()
        del snaps[sid]

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
        siblings = anc.dependents if anc is not None else self.top
        moved = [d for d in siblings if d.frontier > s.frontier and s.covers(d)]
        for d in moved:
            del siblings[d]
            d.ancestor = s
            s.dependents[d] = None
            d.dirty = True
            if d.superseded:
                self.dirty_dependents(d)
        siblings[s] = None

    # ------------------------------------------------------------------ GDSF dirtiness
    def dirty_sole_owner(self, node: BlockNode) -> None:
        """A host copy of ``node`` came or went: its sole retained owner's Z changed."""
        if node.retained_below == 1:
            s = self.snapshots.get(node.retained_xor)
            if s is not None:
                s.dirty = True

    def dirty_dependents(self, s: Snapshot) -> None:
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

    # ------------------------------------------------------------------ supersession (§9.3)
    def supersede(self, s: Snapshot) -> bool:
        """Mark ``s`` superseded (only a retry or edit diverging before its successor can still
        use it). A Boundary snapshot is superseded only while the tree below it is one chain."""
        if not s.alive or s.superseded:
            return False
        if s.kind is SnapshotKind.BOUNDARY and not self._single_chain_below(s):
            return False
        self.clock.tick += 1
        s.superseded = True
        self.superseded[s] = None
        s.dirty = True
        self._path_retained(s, -1)
        self.dirty_dependents(s)
        self.counters.superseded += 1
        return True

    def retain(self, s: Snapshot) -> None:
        """A hit on a superseded snapshot retains it again."""
        s.superseded = False
        del self.superseded[s]
        self._path_retained(s, +1)
        self.dirty_dependents(s)
        s.dirty = True
        self.counters.retained_again += 1

    def hit(self, s: Snapshot) -> None:
        """An admission resumes from ``s``: one more hit, L_s moves up to L (§9.3)."""
        clock = self.clock
        clock.tick += 1
        s.hits += 1
        s.last_hit_tick = clock.tick
        s.l_base = clock.L
        s.dirty = True
        if s.superseded:
            self.retain(s)
        self.counters.snapshot_hits += 1

    def supersede_lineage(self, seq: SequencePath, kind: SnapshotKind, frontier: int) -> None:
        """A new snapshot of ``seq`` at ``frontier``: the snapshot it resumed from and, for a
        tap, its previous tap are superseded."""
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
