"""The file format: mismatch helpers, damage never loads, media keys survive a save and a load
and a malformed media record is damage (spec §5.5; hpc_cli/cache/cachefile/format.py).

Media keys: the Vision items of each block and the media key of each snapshot tail survive a save
and a load, so a restored tier still tells images apart, and `hpc-cli cache inspect` lists them."""

from __future__ import annotations

import hashlib
import json

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from hpc_cli.cache.cachefile.format import FORMAT_VERSION, Geometry, fingerprint_diff, geometry_diff, open_cache_file
from hpc_cli.cache.cachefile.plan import adopt_plan, export_saveable, plan_host_restore
from hpc_cli.cache.cachefile.slab_io import read_plan_slabs, save_cache_file
from hpc_cli.cache.keys import BLOCK_TOKENS, MediaItem, prepare_prompt, token_bytes
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.cli.cache_view import summarize

from .conftest import FP, SLAB, fill, geom, make_index, try_load


def test_mismatch_helpers():
    assert fingerprint_diff(FP, {**FP, "kv_profile": "fp8"}) == ["kv_profile"]
    assert geometry_diff(geom(), Geometry(SLAB, SLAB, SLAB)) == ["image_bytes"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bit_flips_never_load(sound_file, tmp_path, data):
    pos = data.draw(st.one_of(st.integers(0, 4095), st.integers(0, len(sound_file) - 1)))
    bit = data.draw(st.integers(0, 7))
    d = bytearray(sound_file)
    d[pos] ^= 1 << bit
    assert not try_load(bytes(d), tmp_path)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncation_never_loads(sound_file, tmp_path, data):
    n = data.draw(st.integers(0, len(sound_file) - 1))
    assert not try_load(sound_file[:n], tmp_path)
    assert not try_load(sound_file + b"\0" * data.draw(st.integers(1, 5000)), tmp_path)


# ------------------------------------------------------------------ media keys
PAD = 265


def _prompt(n: int, spans: list[tuple[int, int, str]]):
    toks = [1 + (i * 11) % 200 for i in range(n)]
    items = []
    for begin, length, name in spans:
        toks[begin:begin + length] = [PAD] * length
        items.append(MediaItem(hashlib.sha256(name.encode()).digest(), 1, (1, 8, 6), begin, length))
    return toks, prepare_prompt(toks, items)


def _run(ix, host, toks, prepared, frontiers, page=[0]):
    seq = ix.begin_sequence()
    for f in sorted(frontiers):
        d = f // BLOCK_TOKENS
        while len(seq.nodes) < d:
            b = len(seq.nodes)
            page[0] += 1
            ix.commit_block(seq, prepared.blocks[b], (page[0],), extra=prepared.extras[b], h=prepared.hashes[b],
                            media=prepared.block_media(b))
        tail = f - d * BLOCK_TOKENS
        g = ix.acquire_snapshot_slot(seq, SnapshotKind.TAP, f, tail)
        page[0] += 1
        pr = ix.publish(seq, SnapshotKind.TAP, f, slot=g.slot, tail_tokens=token_bytes(toks[d * BLOCK_TOKENS:f]),
                        tail_pages=(page[0],) if tail else None, tail_extra=prepared.tail_extra(d * BLOCK_TOKENS, f))
        fill(ix, host, pr.write)
        ix.land_write(pr.write)
    rel = ix.release(seq)
    fill(ix, host, rel.write)
    ix.land_write(rel.write)


def _frontiers(ix, prepared):
    return sorted(s.frontier for s in ix.match(prepared).candidates)


def test_media_keys_survive_save_and_load(tmp_path):
    ix, host = make_index(200)
    toks, cat = _prompt(260, [(70, 12, "cat"), (150, 12, "owl")])
    for f in (140, 170, 230):  # 170: a tail [128, 170) holding the owl; one sequence each (none supersedes)
        _run(ix, host, toks, cat, [f])
    path = tmp_path / "prefix.bin"
    save_cache_file(path, FP, geom(), export_saveable(ix), host.view, fsync=False)

    cf = open_cache_file(path)
    assert cf.format == FORMAT_VERSION == 2
    media = {i: b.media for i, b in enumerate(cf.blocks) if b.media}
    assert [it.content_digest for items in media.values() for it in items] == \
        [hashlib.sha256(b"cat").digest(), hashlib.sha256(b"owl").digest()]
    assert sorted(s.tail_extra != 0 for s in cf.snapshots) == [False, False, True]

    ix2, host2 = make_index(200)
    plan = plan_host_restore(cf, ix2.host.free_slabs)
    mapping = read_plan_slabs(cf, plan, host2.view, ix2.host.alloc(plan.slabs, 1, "loading"))
    adopt_plan(ix2, cf, plan, mapping)
    ix2.check_invariants()
    _, other_owl = _prompt(260, [(70, 12, "cat"), (150, 12, "eel")])
    _, other_cat = _prompt(260, [(70, 12, "dog"), (150, 12, "owl")])
    assert _frontiers(ix2, cat) == _frontiers(ix, cat) == [140, 170, 230]
    assert _frontiers(ix2, other_owl) == [140]  # the tail at 170 holds the other image
    assert _frontiers(ix2, other_cat) == []  # block 1 holds the other image
    assert [n.media for n in ix2.match(cat).path if n.media] == [cat.block_media(1), cat.block_media(2)]

    summary = summarize(cf)["media"]
    assert summary["images"] == 2 and summary["tail_keyed_snapshots"] == 1
    assert {d["digest"] for d in summary["items"]} == {hashlib.sha256(n).hexdigest() for n in (b"cat", b"owl")}
    from hpc_cli.cli import cli

    out = CliRunner().invoke(cli, ["cache", "inspect", str(path), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["media"]["images"] == 2
    text = CliRunner().invoke(cli, ["cache", "inspect", str(path), "--tree"], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert hashlib.sha256(b"owl").hexdigest()[:12] in text.output


def test_a_media_record_on_a_block_without_a_media_key_is_damage(tmp_path):
    ix, host = make_index(100)
    toks, cat = _prompt(200, [(70, 12, "cat")])
    _run(ix, host, toks, cat, [150])
    plan = export_saveable(ix)
    plan.blocks[0].media = plan.blocks[1].media  # block 0 has extra 0: a writer bug the reader catches
    path = tmp_path / "bad.bin"
    save_cache_file(path, FP, geom(), plan, host.view, fsync=False)
    import pytest

    from hpc_cli.errors import CacheFileError

    with pytest.raises(CacheFileError, match="no media key"):
        open_cache_file(path)
