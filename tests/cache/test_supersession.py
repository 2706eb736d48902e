"""§13.1 Supersession (spec §9.3, hpc_cli/cache/supersession.py): lineage, Boundary."""

from hpc_cli.cache import PrefixIndex, SnapshotKind

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
