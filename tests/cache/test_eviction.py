"""§13.1 Host eviction (spec §9.3, hpc_cli/cache/eviction.py): image writes and GDSF."""

from hpc_cli.cache import PrefixIndex

from .sim import TOKEN_COST, Sim, blocks_of, geometry, publish_tap


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def test_host_image_write_displaces_only_snapshots_worth_no_more_than_the_new_one():
    ix, sim = make(host_slabs=8, slots=3)
    seq, big, _ = publish_tap(ix, sim, blocks_of(1, 2, 3, 4, 5), 320)
    ix.land_write(big.write)
    rel = ix.release(seq)
    ix.land_write(rel.write)  # host full: 5 blocks + 3 image slabs
    seq, small, _ = publish_tap(ix, sim, blocks_of(6), 64)
    assert small.write is None and big.snapshot.host_state.name == "RESIDENT"
    seq2, rich, _ = publish_tap(ix, sim, blocks_of(7, 8, 9, 10, 11, 12, 13, 14), 512)
    assert rich.write is not None  # worth more: big gives up its host copy
    assert big.snapshot.host_state.name == "ABSENT"
    ix.land_write(rich.write)
    ix.check_invariants()
