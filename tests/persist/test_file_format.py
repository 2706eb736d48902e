"""The prefix cache file on a pure index: round trip, partial restore, damage (spec §5.5)."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hpc_cli.cache import persist
from hpc_cli.cache.keys import prepare_prompt
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.errors import CacheFileError

from .conftest import FP, SLAB, geom, make_index, run_prompt, tokens


def _populated():
    ix, host = make_index(400)
    base = tokens(64 * 6, 1)
    run_prompt(ix, host, base, [200])                         # one conversation prefix
    run_prompt(ix, host, base[:128] + tokens(200, 2), [300])  # shares 2 blocks, diverges
    run_prompt(ix, host, tokens(150, 3), [64, 130], hits=5)   # tap (superseded by 130) and endpoint
    run_prompt(ix, host, tokens(40, 4), [40])                 # anchored on the root
    ix.check_invariants()
    return ix, host, base


def _save(tmp_path: Path, ix, host, fp=FP, g=None) -> Path:
    path = tmp_path / "prefix.bin"
    plan = persist.export_saveable(ix)
    persist.save_cache_file(path, fp, g or geom(), plan, host.view, fsync=False)
    return path


def _load(path: Path, num_slabs: int):
    ix, host = make_index(num_slabs)
    cf = persist.open_cache_file(path)
    plan = persist.plan_host_restore(cf, ix.host.free_slabs)
    slabs = ix.host.alloc(plan.slabs, 1, "loading")
    mapping = persist.read_plan_slabs(cf, plan, host.view, slabs)
    persist.adopt_plan(ix, cf, plan, mapping)
    ix.check_invariants()
    return ix, host, cf, plan


def _frontiers(ix, toks):
    return [s.frontier for s in ix.match(prepare_prompt(toks)).candidates]


def test_export_subset_leaves_out_superseded_and_device_only():
    ix, host, _ = _populated()
    plan = persist.export_saveable(ix)
    sup = [s for s in ix.snapshots.values() if s.superseded]
    assert sup, "the scenario has a superseded snapshot"
    assert len(plan.snapshots) == len(ix.snapshots) - len(sup)
    assert all(s.kind is not None for s in plan.snapshots)
    # exactly the paths: every block is on some saved snapshot's path
    on_path = set()
    for s in plan.snapshots:
        i = s.anchor
        while i >= 0:
            on_path.add(i)
            i = plan.blocks[i].parent
    assert on_path == set(range(len(plan.blocks)))
    assert all(b.parent < i for i, b in enumerate(plan.blocks))


def test_round_trip_same_matches_and_bytes(tmp_path):
    ix, host, base = _populated()
    path = _save(tmp_path, ix, host)
    ix2, host2, cf, plan = _load(path, 400)
    assert plan.complete
    probes = [base + [7] * 10, base[:128] + tokens(200, 2) + [9], tokens(150, 3) + [1], tokens(40, 4) + [2, 3]]
    for p in probes:
        assert _frontiers(ix2, p) == [f for f in _frontiers(ix, p)
                                      if not any(s.superseded and s.frontier == f for s in ix.snapshots.values())]
        assert _frontiers(ix2, p)
    # every restored slab holds the saved bytes; entries are host-only
    by_key = {(s.anchor.path()[-1].tokens if s.anchor.depth >= 0 else b"", s.tail_tokens): s
              for s in ix.snapshots.values()}
    for s in ix2.snapshots.values():
        o = by_key[(s.anchor.path()[-1].tokens if s.anchor.depth >= 0 else b"", s.tail_tokens)]
        assert s.hits == o.hits and s.kind == o.kind and s.device_slot == -1
        for a, b in zip(s.host_slabs, o.host_slabs):
            assert bytes(host2.view(a)) == bytes(host.view(b))
    for n in ix2.tree.walk():
        assert n.device_state == persist.RESIDENT.__class__.ABSENT and n.host_state == persist.RESIDENT


def test_partial_restore_keeps_densest(tmp_path):
    ix, host, _ = _populated()
    path = _save(tmp_path, ix, host)
    cf = persist.open_cache_file(path)
    dens = sorted(((persist.density(cf, s), j) for j, s in enumerate(cf.snapshots)), reverse=True)
    best = cf.snapshots[dens[0][1]]
    need_best = cf.snapshot_slabs(best) + len(cf.path_of(best))
    plan = persist.plan_host_restore(cf, need_best)
    assert not plan.complete and plan.snapshots == [dens[0][1]]
    assert plan.blocks == cf.path_of(best)  # the path blocks it needs and no others
    if need_best >= cf.geometry.image_slabs + 1:
        ix2, _, _, plan2 = _load(path, need_best)
        assert len(ix2.snapshots) == 1 and next(iter(ix2.snapshots.values())).frontier == best.frontier
        assert ix2.tree.size == len(cf.path_of(best))
    # too small for any snapshot: nothing
    plan3 = persist.plan_host_restore(cf, cf.geometry.image_slabs - 1)
    assert not plan3.snapshots and not plan3.blocks and plan3.slabs == 0


def test_greedy_is_density_order(tmp_path):
    ix, host, _ = _populated()
    cf = persist.open_cache_file(_save(tmp_path, ix, host))
    for free in range(0, 60, 3):
        plan = persist.plan_host_restore(cf, free)
        assert plan.slabs <= free or plan.complete
        # a skipped snapshot denser than a taken one must not have fitted at its turn
        taken = set(plan.snapshots)
        assert all(i in plan.blocks for j in taken for i in cf.path_of(cf.snapshots[j]))


def test_mismatch_helpers():
    assert persist.fingerprint_diff(FP, {**FP, "kv_profile": "fp8"}) == ["kv_profile"]
    assert persist.geometry_diff(geom(), persist.Geometry(SLAB, SLAB, SLAB)) == ["image_bytes"]


def test_abandoned_save_keeps_previous_file(tmp_path):
    ix, host, _ = _populated()
    path = _save(tmp_path, ix, host)
    before = path.read_bytes()
    ev = threading.Event()
    run_prompt(ix, host, tokens(300, 9), [299])
    calls = []

    def read(s):
        calls.append(s)
        ev.set()  # a second Ctrl+C arrives during the first slab run
        return host.view(s)

    with pytest.raises(persist.SaveAbandoned):
        persist.save_cache_file(path, FP, geom(), persist.export_saveable(ix), read, abandon=ev, fsync=False)
    assert calls and path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["prefix.bin"]
    with pytest.raises(persist.SaveAbandoned):  # set before the save: it never begins
        persist.save_cache_file(path, FP, geom(), persist.export_saveable(ix), host.view, abandon=ev)
    assert path.read_bytes() == before


@pytest.fixture(scope="module")
def sound_file(tmp_path_factory):
    ix, host, _ = _populated()
    return _save(tmp_path_factory.mktemp("fuzz"), ix, host).read_bytes()


def _try_load(data: bytes, tmp: Path) -> bool:
    p = tmp / "f.bin"
    p.write_bytes(data)
    ix, host = make_index(400)
    try:
        cf = persist.open_cache_file(p)
        plan = persist.plan_host_restore(cf, ix.host.free_slabs)
        slabs = ix.host.alloc(plan.slabs, 1, "loading")
        try:
            mapping = persist.read_plan_slabs(cf, plan, host.view, slabs)
        except CacheFileError:
            ix.host.free(slabs)
            raise
        persist.adopt_plan(ix, cf, plan, mapping)
        return True
    except CacheFileError:
        assert ix.tree.size == 0 and not ix.snapshots and ix.host.free_slabs == 400
        ix.check_invariants()
        return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bit_flips_never_load(sound_file, tmp_path, data):
    pos = data.draw(st.one_of(st.integers(0, 4095), st.integers(0, len(sound_file) - 1)))
    bit = data.draw(st.integers(0, 7))
    d = bytearray(sound_file)
    d[pos] ^= 1 << bit
    assert not _try_load(bytes(d), tmp_path)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncation_never_loads(sound_file, tmp_path, data):
    n = data.draw(st.integers(0, len(sound_file) - 1))
    assert not _try_load(sound_file[:n], tmp_path)
    assert not _try_load(sound_file + b"\0" * data.draw(st.integers(1, 5000)), tmp_path)


def test_sound_file_loads_and_verifies(sound_file, tmp_path):
    assert _try_load(sound_file, tmp_path)
    cf = persist.open_cache_file(tmp_path / "f.bin")
    assert persist.verify_slabs(cf) == []
