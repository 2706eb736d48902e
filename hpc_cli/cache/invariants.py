"""check_invariants(): walk the whole index against spec §10 and the accounting of §5 and §9.

Raises AssertionError with a message naming the object and the rule. It is O(everything) and
meant for tests and debugging, never for the serving path. It also recounts every gauge the
index keeps incrementally (``ix.tally``, the host pool's slabs by use) so a missed update is
caught by any test that checks invariants.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hpc_cli.cache.host import SlabUse
from hpc_cli.cache.ids import PageBundle
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.records import ADOPTING
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.tree import ABSENT, FILLING, RESIDENT, BlockNode

if TYPE_CHECKING:
    from hpc_cli.cache.index import PrefixIndex


def check_invariants(ix: PrefixIndex) -> list[set[int]]:
    tree = ix.tree
    root = tree.root
    npools = ix.geometry.num_pools
    assert root.parent is None and root.depth == -1 and root.alive, "root malformed"
    assert not root.pinned and root.lru_list is None, "root is never pinned or in the LRU"

    # --- expected pins and refs from sequences and transfers
    refs = Counter()
    for seq in ix.sequences.values():
        assert not seq.released, f"released sequence {seq.id} still registered"
        for i, n in enumerate(seq.nodes):
            assert n.alive, f"sequence {seq.id}: path node {i} was deleted while pinned"
            assert n.depth == i, f"sequence {seq.id}: node at position {i} has depth {n.depth}"
            if i:
                assert n.parent is seq.nodes[i - 1], f"sequence {seq.id}: path broken at block {i}"
            refs[n] += 1
    pins = Counter()
    for b in ix.restores.values():
        for bt in b.blocks:
            pins[bt.node] += 1
        if b.snapshot is not None:
            pins[b.snapshot.snapshot] += 1
    for w in ix.writes.values():
        for bt in w.blocks:
            pins[bt.node] += 1
        for st in w.snapshots:
            pins[st.snapshot] += 1
    for seq in ix.sequences.values():
        if seq.stage_pin is not None:
            pins[seq.stage_pin] += 1

    # --- nodes (§5.2, §10.1-10.3, §9.4)
    pages_seen: list[dict[int, object]] = [dict() for _ in range(npools)]

    def own_pages(owner: object, pages: PageBundle | None) -> None:
        assert pages is not None and len(pages) == npools, f"{owner!r}: page bundle {pages} malformed"
        for p, pg in enumerate(pages):
            other = pages_seen[p].get(pg)
            assert other is None, f"device page {pg} of pool {p} owned by {owner!r} and {other!r} (§10.1)"
            pages_seen[p][pg] = owner

    live_calc: Counter = Counter()
    retained_calc: Counter = Counter()
    xor_calc: Counter = Counter()
    all_nodes: list[BlockNode] = []
    count = 0
    stack = [root]
    while stack:
        n = stack.pop()
        all_nodes.append(n)
        kids = list(n.iter_children())
        assert len(kids) == n.n_children, f"{n!r}: n_children {n.n_children} but {len(kids)} children"
        keys = set()
        for c in kids:
            assert c.parent is n, f"{c!r}: parent link does not match its child map"
            assert c.depth == n.depth + 1, f"{c!r}: depth {c.depth} under parent depth {n.depth}"
            assert c.alive, f"{c!r}: deleted node still linked"
            assert len(c.tokens) == 4 * BLOCK_TOKENS, f"{c!r}: {len(c.tokens) // 4} tokens"
            key = (c.tokens, c.extra)
            assert key not in keys, f"{c!r}: two children with the same tokens and extra (§5.1)"
            keys.add(key)
        for h, head in n.children.items():
            c = head
            while c is not None:
                assert c.hash == h, f"{c!r}: chained under hash {h:#x} but its hash is {c.hash:#x}"
                c = c.hash_next
        stack.extend(kids)
        if n is root:
            continue
        count += 1
        # residency
        assert (n.device_state == ABSENT) == (n.device_pages is None), \
            f"{n!r}: device state {n.device_state.name} with pages {n.device_pages}"
        if n.device_pages is not None:
            own_pages(n, n.device_pages)
        assert (n.host_state == ABSENT) == (n.host_slab < 0), f"{n!r}: host state vs slab {n.host_slab}"
        if n.host_slab >= 0:
            assert ix.host.owner_of(n.host_slab) is n and ix.host.use_of(n.host_slab) == SlabUse.NODE, \
                f"{n!r}: host slab {n.host_slab} owned by {ix.host.owner_of(n.host_slab)!r}"
        assert n.device_state != ABSENT or n.host_state != ABSENT, f"{n!r}: no copy left but not deleted (§9.4)"
        if n.device_state == FILLING:
            assert n.restore_pins > 0 and n.host_state == RESIDENT, f"{n!r}: device Filling without a pinned host source"
        if n.host_state == FILLING:
            assert n.restore_pins > 0 and n.device_state == RESIDENT, f"{n!r}: host Filling without a pinned device source"
        assert n.active_refs == refs[n], f"{n!r}: active_refs {n.active_refs}, sequences hold {refs[n]}"
        assert n.restore_pins == pins[n], f"{n!r}: restore_pins {n.restore_pins}, transfers hold {pins[n]}"
        if n.active_refs:
            assert n.device_state != ABSENT or n in ix.residency.awaiting_restore, \
                f"{n!r}: on an active path without a device copy (§10.3)"
            assert n.parent.is_root or n.parent.active_refs > 0, f"{n!r}: pinned below an unpinned parent"
        # device LRU (§9.1)
        ps = sum(1 for s in n.snapshots if s.restore_pins > 0)
        assert n.pinned_snaps == ps, f"{n!r}: pinned_snaps {n.pinned_snaps}, counted {ps}"
        self_pin = 1 if (n.restore_pins or ps) else 0
        assert n.self_pin == self_pin, f"{n!r}: self_pin {n.self_pin}, expected {self_pin}"
        mass = self_pin + sum(1 for c in kids if c.pin_mass > 0)
        assert n.pin_mass == mass, f"{n!r}: pin_mass {n.pin_mass}, expected {mass}"
        want = None
        if n.device_state == RESIDENT and not n.pinned:
            if n.host_state == RESIDENT:
                want = ix.lru_backed
            elif n.pin_mass == 0:  # a transfer below keeps a device-only node out (§6.5)
                want = ix.lru_unbacked
        assert n.lru_list is want, \
            f"{n!r}: in LRU {getattr(n.lru_list, 'name', None)}, expected {getattr(want, 'name', None)}"
        # dead KV (§9.3 step 1)
        dead = (n.host_state == RESIDENT and n.live_snapshots_below == 0 and not n.pinned
                and (n.device_state != ABSENT or n.n_children == 0))
        assert (n in ix.residency.dead.nodes) == dead, f"{n!r}: dead-KV membership {n in ix.residency.dead.nodes}, expected {dead}"
    assert count == tree.size, f"tree size {tree.size} but {count} nodes reachable"
    for n in ix.residency.dead.nodes:
        assert n.alive, f"{n!r}: deleted node in the dead-KV set"
    for n in ix.residency.awaiting_restore:
        assert n.alive and n.active_refs > 0 and n.device_state == ABSENT, f"{n!r}: awaiting restore but {n!r}"

    # --- snapshots (§5.3, §10.4)
    per_anchor: dict[tuple[int, bytes], Snapshot] = {}
    anchored = 0
    for n in all_nodes:
        for s in n.snapshots:
            assert s.anchor is n, f"{s!r}: listed under node {n.id}"
            anchored += 1
    assert anchored == len(ix.snapshots), f"{anchored} anchored snapshots, table holds {len(ix.snapshots)}"
    snaps = list(ix.snapshots.values())
    for s in snaps:
        assert s.alive and ix.snapshots.get(s.id) is s, f"{s!r}: table entry broken"
        a = s.anchor
        assert a.alive and s in a.snapshots, f"{s!r}: anchor {a.id} deleted or does not list it"
        assert s.frontier == BLOCK_TOKENS * (a.depth + 1) + s.tail_len, f"{s!r}: frontier vs anchor and tail"
        assert s.tail_len < BLOCK_TOKENS, f"{s!r}: tail of {s.tail_len} tokens"
        key = (a.id, s.tail_tokens, s.tail_extra)
        assert key not in per_anchor, f"{s!r} duplicates {per_anchor.get(key)!r}: one per (anchor, tail) (§5.3)"
        per_anchor[key] = s
        # image
        assert (s.device_slot >= 0) == (s.device_state == RESIDENT), f"{s!r}: slot vs device state"
        if s.device_slot >= 0:
            assert ix.slot_owner[s.device_slot] is s, f"{s!r}: slot {s.device_slot} owned by {ix.slot_owner[s.device_slot]!r}"
        assert (len(s.host_slabs) == (ix.image_slabs if s.host_state != ABSENT else 0)), \
            f"{s!r}: {len(s.host_slabs)} image slabs, expected {ix.image_slabs}"
        for sl in s.host_slabs:
            assert ix.host.owner_of(sl) is s and ix.host.use_of(sl) == SlabUse.IMAGE, f"{s!r}: image slab {sl} not its own"
        if s.host_state == FILLING:
            assert s.restore_pins > 0 and s.device_state == RESIDENT, f"{s!r}: image Filling without a pinned source"
        assert s.device_state == RESIDENT or s.host_state == RESIDENT, f"{s!r}: image has no copy (§5.3 validity)"
        # tail
        if s.tail_tokens:
            assert (s.tail_pages is None) == (s.tail_device_state == ABSENT), f"{s!r}: tail pages vs state"
            if s.tail_pages is not None:
                own_pages(s, s.tail_pages)
            assert (s.tail_host_slab < 0) == (s.tail_host_state == ABSENT), f"{s!r}: tail slab vs state"
            if s.tail_host_slab >= 0:
                assert ix.host.owner_of(s.tail_host_slab) is s and ix.host.use_of(s.tail_host_slab) == SlabUse.TAIL, \
                    f"{s!r}: tail slab {s.tail_host_slab} not its own"
            assert s.tail_device_state != ABSENT or s.tail_host_state != ABSENT, f"{s!r}: tail has no copy (§5.3)"
            if s.tail_device_state == FILLING:
                assert s.restore_pins > 0, f"{s!r}: tail Filling without a pin"
            want = None
            if s.tail_device_state == RESIDENT and s.restore_pins == 0:
                want = ix.lru_backed if s.tail_host_state == RESIDENT else ix.lru_unbacked
            assert s.lru_list is want, f"{s!r}: tail LRU membership {getattr(s.lru_list, 'name', None)}"
        else:
            assert s.tail_pages is None and s.tail_host_slab < 0 and s.lru_list is None, f"{s!r}: tail parts without tail"
        assert s.restore_pins == pins[s], f"{s!r}: restore_pins {s.restore_pins}, holders {pins[s]}"
        assert s.superseded == (s in ix.lineage.superseded), f"{s!r}: superseded flag vs queue"
        # counts along the path
        n = a
        while n.parent is not None:
            live_calc[n] += 1
            if not s.superseded:
                retained_calc[n] += 1
                xor_calc[n] ^= s.id
            n = n.parent
        # ancestor and dependents (§9.3)
        best = None
        for t in snaps:
            if t is not s and t.covers(s) and (best is None or t.frontier > best.frontier):
                best = t
        assert s.ancestor is best, f"{s!r}: ancestor {s.ancestor!r}, nearest above is {best!r}"
        up = s.ancestor.dependents if s.ancestor is not None else ix.lineage.top
        assert s in up, f"{s!r}: missing from its ancestor's dependents"
        for d in s.dependents:
            assert d.alive and d.ancestor is s, f"{s!r}: dependent {d!r} does not point back"
        if not s.dirty:
            from hpc_cli.cache import gdsf
            c = gdsf.value_c(s, ix.cost, ix.image_bytes)
            z = gdsf.size_z(s, ix.image_bytes, ix.block_bytes)
            h = gdsf.priority(s.l_base, s.hits, c, z)
            assert abs(h - s.gdsf_h) <= 1e-9 * max(1.0, abs(h)), \
                f"{s!r}: cached H {s.gdsf_h} but C and Z now give {h} (a change did not mark it dirty)"
    for d in ix.lineage.top:
        assert d.alive and d.ancestor is None, f"{d!r}: in the top set with an ancestor"
    for s in ix.lineage.superseded:
        assert s.alive and s.superseded, f"{s!r}: in the superseded queue but not superseded"
    for n in all_nodes[1:]:
        assert n.live_snapshots_below == live_calc[n], \
            f"{n!r}: live_snapshots_below {n.live_snapshots_below}, counted {live_calc[n]}"
        assert n.retained_below == retained_calc[n], \
            f"{n!r}: retained_below {n.retained_below}, counted {retained_calc[n]}"
        assert n.retained_xor == xor_calc[n], f"{n!r}: retained_xor out of date"

    # --- device snapshot slots (§9.2)
    free_slots = set(ix.slots.free)
    assert len(free_slots) == len(ix.slots.free), "a snapshot slot is on the free list twice"
    for i, o in enumerate(ix.slot_owner):
        if o is None:
            assert i in free_slots, f"slot {i}: unowned but not on the free list"
        else:
            assert i not in free_slots, f"slot {i}: owned by {o!r} and on the free list"
            if isinstance(o, Snapshot):
                assert o.alive and o.device_slot == i, f"slot {i}: owner {o!r} does not point back"
            else:
                assert o == "staging", f"slot {i}: unknown owner {o!r}"

    # --- host slab pool (§5.4, §10.1)
    ix.host.check()
    for sl in range(ix.host.num_slabs):
        o = ix.host.owner_of(sl)
        if o is None:
            continue
        if isinstance(o, BlockNode):
            assert o.alive and o.host_slab == sl, f"host slab {sl}: node owner {o!r} does not point back"
        elif o == ADOPTING:  # reserved for entries whose bytes are being copied in
            assert ix.host.use_of(sl) == SlabUse.NODE, f"host slab {sl}: reserved for adoption as {ix.host.use_of(sl)}"
        else:
            assert isinstance(o, Snapshot) and o.alive and (sl in o.host_slabs or sl == o.tail_host_slab), \
                f"host slab {sl}: snapshot owner {o!r} does not point back"

    # --- LRU lists and L
    ix.lru_backed.check()
    ix.lru_unbacked.check()
    assert ix.L >= 0.0, f"GDSF L is negative: {ix.L}"
    for b in ix.restores.values():
        assert not b.landed, f"restore batch {b.id} landed but still open"
    for w in ix.writes.values():
        assert not w.landed, f"write batch {w.id} landed but still open"

    # --- the running tally (what stats.summary and the stepping path read) against a recount
    from hpc_cli.cache.stats import recount

    drift = ix.tally.differences(recount(ix))
    assert not drift, "index tally drifted from a full recount: " + "; ".join(drift)
    return [set(seen) for seen in pages_seen]
