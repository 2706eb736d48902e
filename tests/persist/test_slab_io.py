"""The slab bytes: a round trip keeps every byte, an abandoned save keeps the previous file, a
sound file verifies (spec §5.5; hpc_cli/cache/cachefile/slab_io.py)."""

from __future__ import annotations

import os
import threading

import pytest

from hpc_cli.cache.cachefile.format import open_cache_file
from hpc_cli.cache.cachefile.plan import export_saveable
from hpc_cli.cache.cachefile.slab_io import SaveAbandoned, save_cache_file, verify_slabs
from hpc_cli.cache.keys import prepare_prompt
from hpc_cli.cache.tree import RESIDENT

from .conftest import FP, geom, load_file, populated, run_prompt, save_file, tokens, try_load


def _frontiers(ix, toks):
    return [s.frontier for s in ix.match(prepare_prompt(toks)).candidates]


def test_round_trip_same_matches_and_bytes(tmp_path):
    ix, host, base = populated()
    path = save_file(tmp_path, ix, host)
    ix2, host2, cf, plan = load_file(path, 400)
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
        assert n.device_state == RESIDENT.__class__.ABSENT and n.host_state == RESIDENT


def test_abandoned_save_keeps_previous_file(tmp_path):
    ix, host, _ = populated()
    path = save_file(tmp_path, ix, host)
    before = path.read_bytes()
    ev = threading.Event()
    run_prompt(ix, host, tokens(300, 9), [299])
    calls = []

    def read(s):
        calls.append(s)
        ev.set()  # a second Ctrl+C arrives during the first slab run
        return host.view(s)

    with pytest.raises(SaveAbandoned):
        save_cache_file(path, FP, geom(), export_saveable(ix), read, abandon=ev, fsync=False)
    assert calls and path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["prefix.bin"]
    with pytest.raises(SaveAbandoned):  # set before the save: it never begins
        save_cache_file(path, FP, geom(), export_saveable(ix), host.view, abandon=ev)
    assert path.read_bytes() == before


def test_sound_file_loads_and_verifies(sound_file, tmp_path):
    assert try_load(sound_file, tmp_path)
    cf = open_cache_file(tmp_path / "f.bin")
    assert verify_slabs(cf) == []
