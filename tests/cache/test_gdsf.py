"""§13.1 Host GDSF, with hand-computed priorities.

Geometry: 4096-byte blocks (one slab each), 12288-byte images (3 slabs); prefill costs one
second a token and restores cost nothing, so C(s) = F_s - F_a.
"""

import pytest

from hpc_cli.cache import PrefixIndex, SnapshotKind, prepare_prompt

from .sim import TOKEN_COST, Sim, blocks_of, geometry

IMG = 12288
BLK = 4096


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def publish_at(ix, sim, toks, frontier, kind=SnapshotKind.TAP):
    """A fresh sequence (no lineage) commits the blocks below ``frontier`` and publishes there."""
    seq = ix.begin_sequence()
    from hpc_cli.cache import token_bytes
    for b in range(frontier // 64):
        ix.commit_block(seq, token_bytes(toks[64 * b:64 * b + 64]), sim.mem.alloc())
    g = ix.acquire_snapshot_slot(None, kind, frontier)
    assert g is not None
    sim.free(g.freed)
    pr = ix.publish(seq, kind, frontier, slot=g.slot)
    sim.free(pr.freed)
    ix.land_write(pr.write)
    rel = ix.release(seq)
    ix.land_write(rel.write)
    sim.mem.give_back(rel.free_pages)
    sim.free(rel.freed)
    return pr.snapshot


def test_gdsf_two_siblings_hand_computed():
    ix, sim = make()
    s1 = publish_at(ix, sim, blocks_of(1, 2, 3), 192)
    s2 = publish_at(ix, sim, blocks_of(1, 2, 4, 5), 256)
    # s1: C = 192, Z = image + block "3" (blocks 1, 2 are shared) = 16384
    assert ix.priority(s1) == pytest.approx(192 / (IMG + BLK))
    # s2: C = 256, Z = image + blocks 4, 5 = 20480
    assert ix.priority(s2) == pytest.approx(256 / (IMG + 2 * BLK))
    assert ix.host_victim() == (s1, pytest.approx(0.01171875))
    ix.check_invariants()


def test_gdsf_nested_ancestor_and_descendant_hand_computed():
    ix, sim = make(slots=2)
    sa = publish_at(ix, sim, blocks_of(1, 2), 128)
    sd = publish_at(ix, sim, blocks_of(1, 2, 3, 4), 256)
    # sa: C = 128 from the root, exclusive path empty (sd lies below blocks 1, 2): Z = image
    assert ix.priority(sa) == pytest.approx(128 / IMG)
    # sd: C = 256 - 128 against its nearest retained ancestor, exclusive blocks 3, 4
    assert ix.priority(sd) == pytest.approx(128 / (IMG + 2 * BLK))
    victim, h = ix.host_victim()
    assert victim is sd
    # superseding sa makes sd carry the whole prefill: C(sd) = 256, and sa's H is no longer used
    ix.supersede(sa)
    assert ix.priority(sd) == pytest.approx(256 / (IMG + 4 * BLK))
    ix.check_invariants()
    # removing sd: sa (retained again) then owns blocks 1, 2 exclusively
    ix.lineage.retain(sa)
    from hpc_cli.cache.records import Freed
    ix.residency.delete_snapshot(sd, Freed())
    assert ix.priority(sa) == pytest.approx(128 / (IMG + 2 * BLK))
    ix.check_invariants()


def test_gdsf_frequency_counts_hits():
    ix, sim = make()
    s1 = publish_at(ix, sim, blocks_of(1, 2, 3), 192)
    s2 = publish_at(ix, sim, blocks_of(1, 2, 4), 192)
    assert ix.priority(s1) == ix.priority(s2) == pytest.approx(192 / (IMG + BLK))
    lane, q = sim.admit(blocks_of(1, 2, 4) + [9])
    assert q.source is s2
    sim.finish(lane)
    assert s2.hits == 1
    assert ix.priority(s2) == pytest.approx(2 * 192 / (IMG + BLK))
    assert ix.host_victim()[0] is s1
    ix.check_invariants()


def test_dead_kv_is_reclaimed_before_any_snapshot():
    ix, sim = make(host_slabs=8, slots=3)
    s1 = publish_at(ix, sim, blocks_of(1, 2), 128)  # 2 nodes + 3 image slabs
    sim.run(blocks_of(7, 8, 9) + [0])  # 3 dead nodes (no snapshot below): host now full
    assert ix.host.free_slabs == 0
    dead_before = ix.stats().host.dead_kv_nodes
    assert dead_before == 3
    sim.run(blocks_of(5, 6) + [0])  # needs 2 slabs
    assert s1.alive and s1.host_state.name == "RESIDENT"
    assert ix.counters.dead_kv_reclaimed == 2 and ix.counters.host_gdsf_evictions == 0
    ix.check_invariants()


def test_victim_exclusive_path_is_freed():
    ix, sim = make(host_slabs=11, slots=1)
    s1 = publish_at(ix, sim, blocks_of(1, 2, 3), 192)  # 3 nodes + 3 image slabs
    s2 = publish_at(ix, sim, blocks_of(1, 2, 4, 5), 256)  # 2 nodes + 3; takes s1's slot (§9.2 step 4)
    assert s1.device_slot == -1 and ix.host.free_slabs == 0
    path = ix.match(prepare_prompt(blocks_of(1, 2, 3) + [0])).path
    b3 = path[2]
    sim.run(blocks_of(7, 8) + [0])  # 2 KV slabs: GDSF evicts s1 (lower H), not device complete
    assert not s1.alive and s2.alive
    assert ix.L == pytest.approx(192 / (IMG + BLK))
    # block "3" was s1's exclusive path: now dead KV, and the next allocation takes it first
    assert b3.alive and b3 in ix.residency.dead.nodes
    sim.run(blocks_of(30, 31, 32) + [0])
    assert not b3.alive or b3.host_state.name == "ABSENT"
    ix.check_invariants()


def test_L_is_monotonic_under_pressure():
    ix, sim = make(host_slabs=16, slots=2)
    last = 0.0
    import random
    rng = random.Random(5)
    for i in range(60):
        toks = blocks_of(*[rng.randrange(6) for _ in range(rng.randrange(1, 5))]) + [i]
        taps = [64 * rng.randrange(1, len(toks) // 64 + 1)] if len(toks) > 64 else []
        sim.run(toks, taps=taps)
        assert ix.L >= last
        last = ix.L
        ix.check_invariants()
    assert ix.counters.host_gdsf_evictions + ix.counters.host_superseded_evictions > 0


def test_host_image_write_displaces_only_snapshots_worth_no_more():
    ix, sim = make(host_slabs=8, slots=3)
    big = publish_at(ix, sim, blocks_of(1, 2, 3, 4, 5), 320)  # 5 nodes + 3 image slabs: full
    assert ix.host.free_slabs == 0
    h_big = ix.priority(big)
    assert h_big == pytest.approx(320 / (IMG + 5 * BLK))
    from hpc_cli.cache import token_bytes
    seq = ix.begin_sequence()
    ix.commit_block(seq, token_bytes(blocks_of(9)), sim.mem.alloc())
    g = ix.acquire_snapshot_slot(None, SnapshotKind.TAP, 64)
    pr = ix.publish(seq, SnapshotKind.TAP, 64, slot=g.slot)
    small = pr.snapshot
    # H(small) = 64 / IMG < H(big): GDSF never inserts what it would evict next
    assert ix.priority(small) == pytest.approx(64 / IMG) and ix.priority(small) < h_big
    assert pr.write is None and ix.counters.image_writes_refused == 1
    assert small.host_state.name == "ABSENT" and small.device_state.name == "RESIDENT"
    assert big.host_state.name == "RESIDENT" and ix.host.free_slabs == 0
    ix.check_invariants()
    ix.release(seq, write_through=False)
    # a snapshot worth more than the big one displaces it (big is complete on the device, so it
    # only gives up its host copy), and L rises to H(big)
    seq = ix.begin_sequence()
    for c in (20, 21, 22):
        ix.commit_block(seq, token_bytes(blocks_of(c)), sim.mem.alloc())
    g = ix.acquire_snapshot_slot(None, SnapshotKind.TAP, 192)
    pr = ix.publish(seq, SnapshotKind.TAP, 192, slot=g.slot)
    richer = pr.snapshot
    assert ix.priority(richer) == pytest.approx(192 / IMG) and ix.priority(richer) > h_big
    assert pr.write is not None
    ix.land_write(pr.write)
    assert richer.host_state.name == "RESIDENT"
    assert big.alive and big.host_state.name == "ABSENT" and big.device_state.name == "RESIDENT"
    assert ix.L == pytest.approx(h_big)
    ix.release(seq, write_through=False)
    ix.check_invariants()
