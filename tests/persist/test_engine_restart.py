"""A real engine restart with builtin:random and a host tier (spec §5.5)."""

from __future__ import annotations

import random

import pytest
import torch

from hpc_cli.cache.cachefile.format import MAGIC, Geometry, SavePlan, open_cache_file
from hpc_cli.cache.cachefile.slab_io import save_cache_file
from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine
from hpc_cli.engine.persistence import attach_cache_file, engine_fingerprint, engine_geometry

KW = dict(kv_pages=64, prefill_chunk=128, max_concurrency=2, host_cache_mib=64)


@pytest.fixture(scope="module")
def model():
    from hpc_cli.model.model import HybridModel

    torch.manual_seed(0)
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


def toks(n, seed):
    r = random.Random(seed)
    return [r.randrange(1, 250) for _ in range(n)]


def gen(e, p, n=8):
    t, f = e.generate(GenerationRequest(list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)),
                      timeout=120)
    assert f.reason in ("length", "stop"), (f.reason, f.error)
    return [x for x in t], f


def conversation(e):
    p1 = toks(300, 1)
    o1, _ = gen(e, p1)
    p2 = p1 + o1 + toks(50, 2)
    o2, _ = gen(e, p2)
    return p2 + o2 + toks(40, 3)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """Engine A: a conversation, the orderly stop saves; also the next turn without restart."""
    path = tmp_path_factory.mktemp("restart") / "prefix.bin"
    a = Engine(model, **KW)
    ra = attach_cache_file(a, path, progress=False)
    assert ra.status == "missing"
    a.start()
    p3 = conversation(a)
    ref = Engine(model, **KW).start()  # the next turn's output with no cache at all
    want, _ = gen(ref, p3)
    ref.stop()
    a.stop()
    assert ra.control.result == "saved" and ra.control.finished.is_set()
    return path, p3, want


def test_restart_reuses_host_tier(model, saved):
    path, p3, want = saved
    b = Engine(model, **KW)
    rb = attach_cache_file(b, path, progress=False, save=False)
    assert rb.status == "restored" and rb.snapshots >= 1 and rb.bytes_read > 0, rb
    b.check_invariants()
    assert all(n.device_state == 0 for n in b.cache.index.tree.walk())  # host-only
    b.start()
    got, fin = gen(b, p3)
    b.stop()
    b.check_invariants()
    assert fin.usage.reuse_tokens > 0 and fin.usage.restored_host_bytes > 0, fin.usage
    assert got == want


def test_a_file_written_with_merged_projections_is_refused_with_them_apart(saved):
    """Merged and apart products round differently: K/V written one way is not what a cold pass
    the other way computes (hpc_cli.model.merged)."""
    from hpc_cli.model.model import HybridModel

    path, _, _ = saved
    apart = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, merge=False)
    b = Engine(apart, **KW)
    r = attach_cache_file(b, path, progress=False, save=False)
    assert r.status == "mismatch" and "prefill_signature" in r.reason, r
    assert b.cache.index.tree.size == 0


def test_fingerprint_or_geometry_mismatch_loads_nothing(model, saved, tmp_path):
    path, p3, _ = saved
    b = Engine(model, **{**KW, "prefill_chunk": 64})  # another prefill signature
    r = attach_cache_file(b, path, progress=False, save=False)
    assert r.status == "mismatch" and "prefill_signature" in r.reason
    assert b.cache.index.tree.size == 0 and not b.cache.index.snapshots
    # geometry: rewrite the file with another slab size recorded, same fingerprint
    c = Engine(model, **KW)
    cf = open_cache_file(path)
    g = engine_geometry(c)
    other = tmp_path / "geo.bin"
    save_cache_file(other, engine_fingerprint(c), Geometry(g.slab_bytes, g.image_bytes + 1, g.block_bytes),
                    SavePlan([], []), lambda s: b"", fsync=False)
    r = attach_cache_file(c, other, progress=False, save=False)
    assert r.status == "mismatch" and "image_bytes" in r.reason and c.cache.index.tree.size == 0
    assert cf.snapshots


def test_damaged_file_loads_nothing_and_says_why(model, saved, tmp_path):
    path, _, _ = saved
    d = bytearray(path.read_bytes())
    d[-10] ^= 0x10
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(d))
    b = Engine(model, **KW)
    free = b.cache.index.host.free_slabs
    r = attach_cache_file(b, bad, progress=False)
    assert r.status == "damaged" and "checksum" in r.reason and r.error is not None and r.error.hint
    assert b.cache.index.tree.size == 0 and b.cache.index.host.free_slabs == free
    b.check_invariants()


def test_fatal_engine_saves_nothing(model, tmp_path):
    path = tmp_path / "prefix.bin"
    previous = MAGIC + b"previous"  # a damaged prefix cache file
    path.write_bytes(previous)
    e = Engine(model, **KW)
    r = attach_cache_file(e, path, progress=False)
    assert r.status == "damaged"
    e.start()
    gen(e, toks(200, 5))

    def boom():
        raise RuntimeError("device fault")

    e.cache.poll = boom
    e._wake.set()
    e._thread.join(10)
    assert e.fatal
    e.stop()
    assert path.read_bytes() == previous and r.control.result is None
    # the hook itself refuses too
    e.on_stop[0](e)
    assert r.control.result.startswith("skipped") and path.read_bytes() == previous


def test_abandon_before_stop_keeps_previous_file(model, saved, tmp_path):
    path, _, _ = saved
    mine = tmp_path / "p.bin"
    mine.write_bytes(path.read_bytes())
    e = Engine(model, **KW)
    r = attach_cache_file(e, mine, progress=False)
    assert r.status == "restored"
    e.start()
    gen(e, toks(260, 11))
    r.control.abandon.set()
    e.stop()
    assert r.control.finished.wait(2) and r.control.result == "abandoned"
    assert mine.read_bytes() == path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["p.bin"]


def test_restart_waits_for_the_chunks_the_file_needs(model, saved, monkeypatch):
    """The host tier pins in the background; the load waits for the chunks it needs, then the
    restart reuses it as before."""
    import time

    from hpc_cli.memory.host_slabs import HostSlabStorage

    path, p3, want = saved
    real = HostSlabStorage._alloc_chunk

    def slow(self, nbytes):
        time.sleep(0.4)  # longer than the engine waits for the first chunk
        return real(self, nbytes)

    monkeypatch.setattr(HostSlabStorage, "_alloc_chunk", slow)
    b = Engine(model, **KW)
    assert b.cache.index.host.ready_slabs == 0 and b.cache.host.progress().state == "pinning"
    rb = attach_cache_file(b, path, progress=False, save=False)
    assert rb.status == "restored" and rb.snapshots >= 1, rb
    assert b.cache.index.host.ready_slabs == b.cache.host.num_slabs
    b.check_invariants()
    b.start()
    got, fin = gen(b, p3)
    b.stop()
    b.check_invariants()
    assert fin.usage.reuse_tokens > 0 and got == want


def test_mismatched_file_is_kept_aside_not_replaced(model, saved, tmp_path):
    """Another engine's cache (here another prefill signature) is never overwritten: the save
    moves it to prefix.bin.old-<fingerprint> and writes this engine's file."""
    from hpc_cli.engine.persistence import file_tag

    path, _, _ = saved
    mine = tmp_path / "prefix.bin"
    mine.write_bytes(path.read_bytes())
    tag = file_tag(mine)
    e = Engine(model, **{**KW, "prefill_chunk": 64})
    r = attach_cache_file(e, mine, progress=False)
    assert r.status == "mismatch"
    e.start()
    gen(e, toks(200, 12))
    e.stop()
    assert r.control.result == "saved"
    kept = tmp_path / f"prefix.bin.old-{tag}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefix.bin", kept.name]
    assert kept.read_bytes() == path.read_bytes()
    assert open_cache_file(mine).fingerprint == engine_fingerprint(e)
    assert len(tag) == 12 and file_tag(mine) != tag


def test_abandoned_save_puts_the_kept_file_back(model, saved, tmp_path):
    path, _, _ = saved
    mine = tmp_path / "prefix.bin"
    mine.write_bytes(path.read_bytes())
    e = Engine(model, **{**KW, "prefill_chunk": 64})
    r = attach_cache_file(e, mine, progress=False)
    e.start()
    r.control.abandon.set()
    e.stop()
    assert r.control.result == "abandoned"
    assert [p.name for p in tmp_path.iterdir()] == ["prefix.bin"] and mine.read_bytes() == path.read_bytes()


def test_other_data_is_refused_and_left_alone(model, tmp_path):
    from hpc_cli.errors import CacheFileError

    path = tmp_path / "prefix.bin"
    data = random.Random(7).randbytes(100_000)
    path.write_bytes(data)
    e = Engine(model, **KW)
    with pytest.raises(CacheFileError, match="holds other data") as exc:
        attach_cache_file(e, path, progress=False)
    assert "--prefix-cache-file" in exc.value.hint
    assert path.read_bytes() == data and e.on_stop == []
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert attach_cache_file(e, empty, progress=False).status == "damaged"  # nothing to keep: replaced


def test_a_file_saved_with_one_drafter_loads_only_with_that_drafter(model, tmp_path):
    """A DFlash2 engine's file (its rings live in the saved images) restores into an engine with the
    same drafter; an engine whose drafter has other weights (a checkpoint directory) refuses it,
    naming the drafter; an engine without speculation refuses it, naming the backend."""
    from hpc_cli.speculative.dflash import DFlashNet, default_config, save_drafter, seed_weights

    path = tmp_path / "prefix.bin"
    a = Engine(model, speculative="dflash2", **KW)
    attach_cache_file(a, path, progress=False)
    a.start()
    conversation(a)
    a.stop()
    saved = open_cache_file(path).fingerprint
    assert saved["speculative_backend"] == "dflash2" and saved["speculative_drafter"]["source"].startswith("seeded:")
    same = Engine(model, speculative="dflash2", **KW)
    r = attach_cache_file(same, path, progress=False, save=False)
    assert r.status == "restored" and r.snapshots >= 1, r
    net = DFlashNet(default_config("dflash2", model, 1))
    seed_weights(net, 7)
    save_drafter(net, str(tmp_path / "other"))
    other = Engine(model, speculative="dflash2", drafter=str(tmp_path / "other"), **KW)
    r = attach_cache_file(other, path, progress=False, save=False)
    assert r.status == "mismatch" and "speculative_drafter" in r.reason, r
    assert other.cache.index.tree.size == 0
    plain = Engine(model, **KW)
    r = attach_cache_file(plain, path, progress=False, save=False)
    assert r.status == "mismatch" and "speculative_backend" in r.reason, r


def test_the_embedded_models_files_are_fingerprinted_by_content(tmp_path, monkeypatch):
    """``builtin:tiny`` and its trained drafters are files the package ships: a release that
    retrains them (a module's size need not change) gives another fingerprint, so a file saved
    with the old weights is refused rather than resumed with stale K/V, pages and rings; a copy
    with the same bytes (another install, other mtimes) gives the same one."""
    import shutil

    from hpc_cli.cache.cachefile.format import fingerprint_diff
    from hpc_cli.model import builtin
    from hpc_cli.model.model import HybridModel

    tiny = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32, device="cpu", progress=False)
    e = Engine(tiny, speculative="dflash", kv_pages=16, max_concurrency=1)
    before = engine_fingerprint(e)
    assert [f[0] for f in before["speculative_drafter"]["files"]] == ["config.json", "model.safetensors"]
    assert "model.safetensors" in [f[0] for f in before["checkpoint_files"]]
    copy = tmp_path / "tiny"
    shutil.copytree(builtin.TINY_DIR, copy)
    monkeypatch.setattr(builtin, "TINY_DIR", copy)
    assert fingerprint_diff(before, engine_fingerprint(e)) == []  # same bytes, new mtimes
    blob = copy / "dflash" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1  # one weight's last bit
    blob.write_bytes(bytes(data))
    assert fingerprint_diff(before, engine_fingerprint(e)) == ["speculative_drafter"]
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert fingerprint_diff(before, engine_fingerprint(e)) == ["checkpoint_files", "speculative_drafter"]
