"""§13.1 Device snapshot slots (spec §9.2, hpc_cli/cache/slots.py): the order of grants."""

import pytest

from hpc_cli.cache import PrefixIndex

from .sim import TOKEN_COST, Sim, blocks_of, geometry, publish_tap


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def test_device_slots_go_to_superseded_then_least_valuable_device_only_then_lru_host_backed():
    # -- step 2: a superseded owner (device-only, so it is deleted)
    ix, sim = make(host_slabs=0, slots=2)
    seq, pr1, g = publish_tap(ix, sim, blocks_of(1, 2, 3, 4), 64)
    assert g.step == 1
    seq, pr2, g = publish_tap(ix, sim, blocks_of(1, 2, 3, 4), 128, seq)  # supersedes pr1's tap
    assert g.step == 1 and pr1.snapshot.superseded
    seq, pr3, g = publish_tap(ix, sim, blocks_of(1, 2, 3, 4), 192, seq)
    assert g.step == 2 and not pr1.snapshot.alive  # no host copy: deleted
    ix.release(seq)
    ix.check_invariants()

    # -- step 3: the least valuable device-only owner, only for a new snapshot worth as much
    ix, sim = make(host_slabs=0, slots=2)
    _, a, _ = publish_tap(ix, sim, blocks_of(1, 2, 3, 4, 5, 6), 384)  # H = 384/IMG
    _, b, _ = publish_tap(ix, sim, blocks_of(7), 64)  # H = 64/IMG: the cheapest owner
    s_small, c, g = publish_tap(ix, sim, blocks_of(8), 32 + 32)  # estimate 64/(IMG+BLK) < 64/IMG
    assert c is None and ix.counters.taps_skipped_no_slot == 1
    seq, d, g = publish_tap(ix, sim, blocks_of(9, 10, 11), 192)  # estimate 192/(IMG+3*BLK) >= 64/IMG
    assert g.step == 3 and not b.snapshot.alive and a.snapshot.alive
    assert ix.L == pytest.approx(64 / 12288)
    ix.check_invariants()

    # -- step 4: the least recently hit host-backed owner loses only its device copy
    ix, sim = make(host_slabs=64, slots=2)
    s1, a, _ = publish_tap(ix, sim, blocks_of(1), 64)
    s2, b, _ = publish_tap(ix, sim, blocks_of(2), 64)
    for s, p in ((s1, a), (s2, b)):
        ix.land_write(p.write)
    ix.tick += 1
    b.snapshot.last_hit_tick = ix.tick  # b was hit more recently
    s3, c, g = publish_tap(ix, sim, blocks_of(3), 64)
    assert g.step == 4 and a.snapshot.alive and a.snapshot.device_slot == -1
    assert a.snapshot.host_state.name == "RESIDENT" and b.snapshot.device_slot >= 0
    ix.check_invariants()
