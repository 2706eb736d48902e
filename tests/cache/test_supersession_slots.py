"""§13.1 Supersession and admission: lineage, Boundary, device slot order, image writes."""

import pytest

from hpc_cli.cache import PrefixIndex, SnapshotKind, prepare_prompt, token_bytes

from .sim import TOKEN_COST, Sim, blocks_of, geometry


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def test_lineage_previous_snapshot_is_superseded_and_a_hit_retains_it():
    ix, sim = make()
    _, (s1,) = sim.run(blocks_of(1, 2) + [0], taps=[128])
    lane, q = sim.admit(blocks_of(1, 2, 3, 4) + [0])
    assert q.source is s1
    t1 = sim.tap(lane, 192)
    assert s1.superseded and not t1.superseded
    t2 = sim.tap(lane, 256)  # the previous tap of the same prompt goes too
    assert t1.superseded and not t2.superseded
    sim.finish(lane, endpoint=257)  # an endpoint leaves the prompt's last tap retained
    assert not t2.superseded
    ix.check_invariants()
    lane, q = sim.admit(blocks_of(1, 2, 9) + [0])  # a retry diverging after s1 hits it
    assert q.source is s1 and not s1.superseded
    sim.finish(lane)
    ix.check_invariants()


def _boundary_conversation(ix, sim):
    lane, _ = sim.admit(blocks_of(1, 2, 3) + [0])
    b = sim.tap(lane, 128, SnapshotKind.BOUNDARY)
    sim.finish(lane)
    return b


def test_boundary_superseded_only_while_no_other_conversation_continued_below():
    ix, sim = make()
    b = _boundary_conversation(ix, sim)
    lane, q = sim.admit(blocks_of(1, 2, 3, 4, 5) + [0])  # the same conversation moves on
    assert q.source is b
    sim.tap(lane, 256)
    assert b.superseded  # below it the tree is one chain
    sim.finish(lane)
    ix.check_invariants()

    ix, sim = make()
    b = _boundary_conversation(ix, sim)
    sim.run(blocks_of(1, 2, 7) + [0])  # another conversation continued from the boundary
    lane, q = sim.admit(blocks_of(1, 2, 3, 4, 5) + [0])
    assert q.source is b
    sim.tap(lane, 256)
    assert not b.superseded
    assert ix.supersede(b) is False
    sim.finish(lane)
    ix.check_invariants()


def _publish(ix, sim, toks, frontier, seq=None):
    seq = seq or ix.begin_sequence()
    while len(seq.nodes) < frontier // 64:
        b = len(seq.nodes)
        ix.commit_block(seq, token_bytes(toks[64 * b:64 * b + 64]), sim.mem.alloc())
    g = ix.acquire_snapshot_slot(seq, SnapshotKind.TAP, frontier)
    if g is None:
        return seq, None, None
    sim.free(g.freed)
    pr = ix.publish(seq, SnapshotKind.TAP, frontier, slot=g.slot)
    sim.free(pr.freed)
    return seq, pr, g


def test_device_slots_go_to_superseded_then_least_valuable_device_only_then_lru_host_backed():
    # -- step 2: a superseded owner (device-only, so it is deleted)
    ix, sim = make(host_slabs=0, slots=2)
    seq, pr1, g = _publish(ix, sim, blocks_of(1, 2, 3, 4), 64)
    assert g.step == 1
    seq, pr2, g = _publish(ix, sim, blocks_of(1, 2, 3, 4), 128, seq)  # supersedes pr1's tap
    assert g.step == 1 and pr1.snapshot.superseded
    seq, pr3, g = _publish(ix, sim, blocks_of(1, 2, 3, 4), 192, seq)
    assert g.step == 2 and not pr1.snapshot.alive  # no host copy: deleted
    ix.release(seq)
    ix.check_invariants()

    # -- step 3: the least valuable device-only owner, only for a new snapshot worth as much
    ix, sim = make(host_slabs=0, slots=2)
    _, a, _ = _publish(ix, sim, blocks_of(1, 2, 3, 4, 5, 6), 384)  # H = 384/IMG
    _, b, _ = _publish(ix, sim, blocks_of(7), 64)  # H = 64/IMG: the cheapest owner
    s_small, c, g = _publish(ix, sim, blocks_of(8), 32 + 32)  # estimate 64/(IMG+BLK) < 64/IMG
    assert c is None and ix.counters.taps_skipped_no_slot == 1
    seq, d, g = _publish(ix, sim, blocks_of(9, 10, 11), 192)  # estimate 192/(IMG+3*BLK) >= 64/IMG
    assert g.step == 3 and not b.snapshot.alive and a.snapshot.alive
    assert ix.L == pytest.approx(64 / 12288)
    ix.check_invariants()

    # -- step 4: the least recently hit host-backed owner loses only its device copy
    ix, sim = make(host_slabs=64, slots=2)
    s1, a, _ = _publish(ix, sim, blocks_of(1), 64)
    s2, b, _ = _publish(ix, sim, blocks_of(2), 64)
    for s, p in ((s1, a), (s2, b)):
        ix.land_write(p.write)
    ix.tick += 1
    b.snapshot.last_hit_tick = ix.tick  # b was hit more recently
    s3, c, g = _publish(ix, sim, blocks_of(3), 64)
    assert g.step == 4 and a.snapshot.alive and a.snapshot.device_slot == -1
    assert a.snapshot.host_state.name == "RESIDENT" and b.snapshot.device_slot >= 0
    ix.check_invariants()


def test_host_image_write_displaces_only_snapshots_worth_no_more_than_the_new_one():
    ix, sim = make(host_slabs=8, slots=3)
    seq, big, _ = _publish(ix, sim, blocks_of(1, 2, 3, 4, 5), 320)
    ix.land_write(big.write)
    rel = ix.release(seq)
    ix.land_write(rel.write)  # host full: 5 blocks + 3 image slabs
    seq, small, _ = _publish(ix, sim, blocks_of(6), 64)
    assert small.write is None and big.snapshot.host_state.name == "RESIDENT"
    seq2, rich, _ = _publish(ix, sim, blocks_of(7, 8, 9, 10, 11, 12, 13, 14), 512)
    assert rich.write is not None  # worth more: big gives up its host copy
    assert big.snapshot.host_state.name == "ABSENT"
    ix.land_write(rich.write)
    ix.check_invariants()
