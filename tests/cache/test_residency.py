"""§13.1 Liveness and the device LRU (spec §9.1, §9.4; hpc_cli/cache/residency.py)."""

from hpc_cli.cache import PrefixIndex, prepare_prompt
from hpc_cli.cache.tree import ABSENT

from .sim import TOKEN_COST, Sim, blocks_of, geometry


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def path_of(ix, toks):
    return ix.match(prepare_prompt(toks + [0])).path


def test_live_snapshots_below_under_interleaved_publish_evict_and_subtree_deletion():
    ix, sim = make(host_slabs=0)  # device only: eviction deletes subtrees
    sim.run(blocks_of(1, 2, 3, 4) + [0], taps=[128, 256])
    sim.run(blocks_of(1, 2, 5, 6) + [0], taps=[192])
    a0, a1 = path_of(ix, blocks_of(1, 2))
    assert (a0.live_snapshots_below, a1.live_snapshots_below) == (3, 3)
    ix.check_invariants()
    # evict from the LRU head: the deepest unbacked blocks go first, with their snapshots
    freed = ix.evict_device(1)
    assert freed.snapshots_deleted >= 1
    ix.check_invariants()
    while ix.evictable_pages():
        ix.evict_device(1)
        ix.check_invariants()
    assert ix.tree.size == 0 and not ix.snapshots


def test_losing_the_last_copy_deletes_exactly_the_subtree_snapshots():
    ix, sim = make()
    _, s_root = sim.run(blocks_of(1, 2) + [0], taps=[64])
    _, (s_b,) = sim.run(blocks_of(1, 2, 3) + [0], taps=[192])
    _, (s_c,) = sim.run(blocks_of(1, 4, 5) + [0], taps=[192])
    n1 = path_of(ix, blocks_of(1, 2))[1]  # block "2": below it only s_b
    freed = ix.drop_copy(n1, device=True, host=True)
    assert freed.snapshots_deleted == 1 and not s_b.alive
    assert s_c.alive and s_root[0].alive
    assert freed.nodes_deleted == 2  # blocks 2 and 3
    ix.check_invariants()


def test_lru_is_tail_first_after_release():
    ix, sim = make(host_slabs=0)
    sim.run(blocks_of(1, 2, 3, 4) + [0])
    order = [n.depth for n in ix.lru_unbacked]
    assert order == [3, 2, 1, 0]  # deepest at the LRU head


def test_hits_move_the_whole_path_to_mru():
    ix, sim = make(host_slabs=0)
    sim.run(blocks_of(1, 2, 3) + [0], taps=[192])
    sim.run(blocks_of(7, 8) + [0])
    # a hit on the first prompt: its whole path leaves the LRU, then returns at the MRU end
    lane, q = sim.admit(blocks_of(1, 2, 3) + [0])
    assert q.reuse_tokens == 192
    p = path_of(ix, blocks_of(1, 2, 3))
    assert all(n.lru_list is None for n in p)
    sim.finish(lane)
    tail = list(ix.lru_unbacked)[-3:]
    assert tail == [p[2], p[1], p[0]]
    # touch() does the same without pinning
    q2 = path_of(ix, blocks_of(7, 8))
    ix.touch(q2)
    assert list(ix.lru_unbacked)[-2:] == [q2[1], q2[0]]


def test_backed_entries_are_consumed_before_unbacked():
    ix, sim = make()
    sim.auto_land = False
    sim.run(blocks_of(1, 2) + [0])  # write-through pending: nodes pinned
    sim.land_all()  # now backed
    sim.run(blocks_of(3, 4) + [0], )
    # leave the second request's writes pending: its nodes stay out of the LRU (pinned)...
    w = sim.pending_writes.pop()
    ix.land_write(w)
    # ... now make unbacked entries: a device-only commit by disabling write-through
    lane, _ = sim.admit(blocks_of(5, 6) + [0])
    sim.finish(lane, write_through=False)
    assert len(ix.lru_unbacked) == 2 and len(ix.lru_backed) == 4
    freed = ix.evict_device(4)
    assert len(freed.pages) == 4 and freed.nodes_deleted == 0
    assert len(ix.lru_unbacked) == 2 and len(ix.lru_backed) == 0
    ix.check_invariants()
    freed = ix.evict_device(1)
    assert freed.nodes_deleted == 1  # an unbacked entry loses its last copy
    ix.check_invariants()


def test_pinned_entries_are_never_returned():
    ix, sim = make(host_slabs=0)
    sim.run(blocks_of(1, 2, 3) + [0])
    lane, _ = sim.admit(blocks_of(1, 2, 3) + [0])  # pins blocks 1..2 (resumes nothing: no snapshot)
    sim.commit(lane, 192)  # duplicates pin all three
    pinned = set(lane.seq.nodes)
    sim.run(blocks_of(8, 9) + [0])
    freed = ix.evict_device(100)
    assert len(freed.pages) == 2
    assert all(n.alive and n.device_state != ABSENT for n in pinned)
    ix.check_invariants()
    sim.finish(lane)
    ix.check_invariants()
