"""Host slab geometry and run planning (spec §5.4, §11.2)."""

from __future__ import annotations

import random

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.errors import CapacityError
from hpc_cli.memory import host_slabs
from hpc_cli.memory.bundle import BundleLayout, image_slab_count
from hpc_cli.memory.host_slabs import GiB, MiB, HostSlabStorage
from hpc_cli.memory.slab_runs import DEFAULT_MAX_PITCH, Run, plan_runs
from hpc_cli.shapes import preset


def _int8_27b_layout(mtp: bool = False) -> BundleLayout:
    shape = preset("qwen3.5-27b")
    lay = plugins.kv_profile("int8-g64").layout(shape.head_dim)
    planes = tuple(64 * shape.num_kv_heads * p.bytes_per_token_head for p in lay.planes)
    return BundleLayout(planes, shape.num_attention_layers + (1 if mtp else 0))


def test_bundle_layout_27b_int8():
    b = _int8_27b_layout()
    assert b.main_bytes == 2162688 == round(2.0625 * MiB)  # 16 layers x 4 heads x 528 B x 64
    assert b.slab_bytes == b.main_bytes  # already 4 KiB aligned
    assert b.main_offset(1, 0) == sum(b.main_plane_bytes) and b.main_offset(0, 2) == 65536 + 2048
    d = BundleLayout((100,), 3, backend_plane_bytes=(50, 10), backend_layers=2)
    assert d.backend_offset == 4096 and d.record_bytes == 4096 + 120 and d.slab_bytes == 8192
    assert d.backend_plane_offset(1, 1) == 4096 + 60 + 50


def test_storage_slabs_never_cross_chunks():
    sb = 8192
    h = HostSlabStorage(sb, 23, pin=False, chunk_bytes=5 * sb + 4000)
    assert h.slabs_per_chunk == 5 and [c.numel() for c in h.chunks] == [5 * sb] * 4 + [3 * sb]
    for s in range(23):
        v = h.slab_view(s)
        c, off = h.location(s)
        assert v.numel() == sb and off + sb <= h.chunks[c].numel()
        v.fill_(s % 251)
    for s in range(23):
        assert h.slab_view(s).eq(s % 251).all()
    with pytest.raises(AssertionError, match="crosses a chunk"):
        h.run_view(3, 3, 1, 0, 100)
    with pytest.raises(CapacityError, match="cannot hold one"):
        HostSlabStorage(8192, 2, pin=False, chunk_bytes=4096)


def test_failed_allocation_names_the_size(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(host_slabs.torch, "empty", boom)
    with pytest.raises(CapacityError, match=r"4294967296 B \(4.00 GiB\).*in all failed") as e:
        HostSlabStorage(4096, 1 << 21, pin=False)
    assert "host-cache-mib" in e.value.hint


def test_budget_smaller_than_one_snapshot_and_block_is_refused():
    with pytest.raises(CapacityError, match="fewer than one snapshot plus one block"):
        HostSlabStorage.for_budget(10 * 4096, 4096, image_bytes=10 * 4096, pin=False)
    h = HostSlabStorage.for_budget(11 * 4096 + 5, 4096, image_bytes=10 * 4096, pin=False)
    assert h.num_slabs == 11
    assert HostSlabStorage.for_budget(0, 4096, 10, pin=False).num_slabs == 0
    assert image_slab_count(153954304, 2162688) == 72


def _check_runs(runs, pairs, slab_bytes, spc, page_bytes, max_pitch):
    got = sorted(p for r in runs for p in r.pairs())
    assert got == sorted(pairs)
    for r in runs:
        assert r.count >= 1
        chunks = {s // spc for _, s in r.pairs()}
        assert len(chunks) == 1, f"{r} crosses chunks"
        if r.count > 1:
            assert 0 < r.slab_stride * slab_bytes <= max_pitch and 0 < r.page_stride * page_bytes <= max_pitch
            # the whole 2-D extent lies inside the chunk
            first = (r.slab0 % spc) * slab_bytes
            assert first + (r.count - 1) * r.slab_stride * slab_bytes + slab_bytes <= spc * slab_bytes


def test_runs_join_consecutive_and_split_on_stride_change():
    runs = plan_runs([(0, 10), (1, 11), (2, 12), (3, 14), (4, 16), (5, 18), (9, 19)],
                     slab_bytes=4096, slabs_per_chunk=1000, page_bytes=4096)
    assert runs == [Run(0, 10, 3), Run(3, 14, 3, 1, 2), Run(9, 19, 1)]
    # descending slabs cannot be one 2-D copy (pitches are unsigned)
    assert all(r.count == 1 for r in plan_runs([(0, 5), (1, 4), (2, 3)], slab_bytes=4096,
                                               slabs_per_chunk=100, page_bytes=4096))


def test_runs_split_at_chunk_boundaries():
    spc = 8
    pairs = [(p, 4 + p) for p in range(20)]  # slabs 4..23 cross chunks 0|1|2
    runs = plan_runs(pairs, slab_bytes=4096, slabs_per_chunk=spc, page_bytes=4096)
    assert [(r.slab0, r.count) for r in runs] == [(4, 4), (8, 8), (16, 8)]
    _check_runs(runs, pairs, 4096, spc, 4096, DEFAULT_MAX_PITCH)


def test_runs_split_past_max_pitch_and_gigabyte_distances():
    sb = 2162688  # 27B INT8 bundle
    spc = (4 * GiB) // sb  # 1985 slabs in a 4 GiB chunk
    gap = 1100  # 1100 slabs = 2.2 GiB apart: same chunk, but past the 2 GiB max pitch
    pairs = [(0, 10), (1, 10 + gap)]
    runs = plan_runs(pairs, slab_bytes=sb, slabs_per_chunk=spc, page_bytes=65536)
    assert [r.count for r in runs] == [1, 1]
    # the same two records a gigabyte apart are fine with a larger max pitch...
    assert plan_runs(pairs, slab_bytes=sb, slabs_per_chunk=spc, page_bytes=65536,
                     max_pitch=4 * GiB)[0].count == 2
    # ...and a device pitch over the limit splits too
    assert [r.count for r in plan_runs([(0, 0), (40000, 1)], slab_bytes=sb, slabs_per_chunk=spc,
                                       page_bytes=65536)] == [1, 1]


def test_52gb_host_tier_simulated_geometry():
    """spec §5.4: a 52 GB host tier once produced an invalid 2-D copy. No real allocation here."""
    sb = _int8_27b_layout(mtp=True).slab_bytes
    num_slabs = (52 * 10**9) // sb
    spc = (4 * GiB) // sb
    rng = random.Random(5)
    for trial in range(30):
        n = rng.choice([2, 8, 64, 256, 1000])
        p0 = rng.randrange(1000)
        pages = sorted(rng.sample(range(200000), n)) if trial % 2 else list(range(p0, p0 + n))
        mode = trial % 3
        if mode == 0:  # scattered slabs anywhere in 52 GB
            slabs = rng.sample(range(num_slabs), n)
        elif mode == 1:  # one stride that lands gigabytes apart
            stride = rng.choice([1, 3, 500, 1500, 9000])
            s0 = rng.randrange(num_slabs - stride * n) if stride * n < num_slabs else 0
            slabs = [(s0 + i * stride) % num_slabs for i in range(n)]
        else:  # consecutive slabs straddling a chunk boundary
            s0 = spc * rng.randrange(1, num_slabs // spc) - n // 2
            slabs = list(range(s0, s0 + n))
        pairs = list(zip(pages, slabs))
        runs = plan_runs(pairs, slab_bytes=sb, slabs_per_chunk=spc, page_bytes=65536)
        _check_runs(runs, pairs, sb, spc, 65536, DEFAULT_MAX_PITCH)


def test_image_pieces_cover_the_image_in_order():
    sb = 4096
    h = HostSlabStorage(sb, 12, pin=False, chunk_bytes=4 * sb)
    slabs = [1, 2, 3, 4, 9, 7]  # 1-3 adjacent in chunk 0; 4 starts chunk 1
    data = torch.randint(0, 256, (6 * sb - 100,), dtype=torch.uint8)
    pieces = h.image_pieces(slabs, 0, data.numel())
    assert [o for _, o in pieces] == [0, 3 * sb, 4 * sb, 5 * sb]
    for v, o in pieces:
        v.copy_(data[o:o + v.numel()])
    for k, s in enumerate(slabs):
        chunk = data[k * sb:(k + 1) * sb]
        assert torch.equal(h.slab_view(s)[:chunk.numel()], chunk)
    # a part in the middle of the image
    mid = h.image_pieces(slabs, 5000, 4000)
    assert [(v.numel(), o) for v, o in mid] == [(4000, 5000)]


# -- allocation and pinning in the background ---------------------------------------------------
def _gated_alloc(monkeypatch, n, fail_at=None):
    """Make chunk ``k``'s allocation wait for ``gates[k]`` (and raise at ``fail_at``)."""
    import threading

    gates = [threading.Event() for _ in range(n)]
    sizes: list[int] = []
    real = HostSlabStorage._alloc_chunk

    def alloc(self, nbytes):
        k = len(sizes)
        sizes.append(nbytes)
        assert gates[k].wait(10), f"chunk {k} never released"
        if k == fail_at:
            raise CapacityError(f"cannot pin chunk {k}: out of locked memory")
        return real(self, nbytes)

    monkeypatch.setattr(HostSlabStorage, "_alloc_chunk", alloc)
    return gates, sizes


def test_background_chunks_become_usable_in_order(monkeypatch):
    from hpc_cli.cache.host import HostSlabPool, SlabUse

    sb = 4096
    gates, sizes = _gated_alloc(monkeypatch, 3)
    seen: list[int] = []
    h = HostSlabStorage(sb, 10, pin=False, chunk_bytes=4 * sb, background=True, on_ready=seen.append)
    pool = HostSlabPool(10 * sb, sb, 2 * sb, chunk_bytes=4 * sb, ready_slabs=h.ready_slabs)
    assert h.ready_slabs == 0 and h.chunks == [] and h.progress().state == "pinning"
    assert pool.alloc(1, SlabUse.NODE, "x") is None  # nothing is handed out before its chunk
    gates[0].set()
    assert h.wait_ready(4, timeout=5) == 4
    pool.grow(h.ready_slabs)
    assert pool.alloc(4, SlabUse.NODE, "x") == [0, 1, 2, 3]
    h.slab_view(3).fill_(7)  # the first chunk is usable while the others are not there yet
    assert h.wait_ready(5, timeout=0.1) == 4 and pool.alloc(1, SlabUse.NODE, "y") is None
    gates[1].set()
    gates[2].set()
    assert h.wait_ready(10, timeout=5) == 10
    pool.grow(h.ready_slabs)
    assert pool.alloc(6, SlabUse.IMAGE, "z") == [4, 5, 6, 7, 8, 9]
    assert seen == [4, 8, 10] and sizes == [4 * sb, 4 * sb, 2 * sb]
    p = h.progress()
    assert (p.state, p.ready_bytes, p.total_bytes, p.ready_chunks, p.total_chunks) == ("ready", 10 * sb, 10 * sb, 3, 3)
    assert [c.numel() for c in h.chunks] == sizes and h.slab_view(3).eq(7).all()
    h.close()
    assert h.progress().state == "closed" and h.chunks == []


def test_background_pinning_waits_for_an_idle_engine_at_most_defer_s(monkeypatch):
    import time

    sb = 4096
    gates, _ = _gated_alloc(monkeypatch, 3)
    h = HostSlabStorage(sb, 12, pin=False, chunk_bytes=4 * sb, background=True, defer_s=30)
    h.may_pin.clear()  # the engine serves: the next chunk waits
    gates[0].set()
    gates[1].set()
    assert h.wait_ready(4, timeout=5) == 4
    assert h.wait_ready(8, timeout=0.3) == 4
    h.may_pin.set()  # idle again
    assert h.wait_ready(8, timeout=5) == 8
    h.may_pin.clear()
    h.defer_s = 0.2  # a chunk waits this long at most, then is pinned anyway
    gates[2].set()
    t0 = time.monotonic()
    assert h.wait_ready(12, timeout=5) == 12 and time.monotonic() - t0 < 4


def test_a_failed_chunk_stops_the_growth_and_says_so(monkeypatch, caplog):
    import logging

    sb = 4096
    gates, _ = _gated_alloc(monkeypatch, 3, fail_at=1)
    seen: list[int] = []
    h = HostSlabStorage(sb, 10, pin=False, chunk_bytes=4 * sb, background=True, on_ready=seen.append)
    with caplog.at_level(logging.WARNING, logger="hpc_cli.memory"):
        for g in gates:
            g.set()
        assert h.wait_ready(10, timeout=5) == 4  # returns as soon as the growth ended
        h._thread.join(5)
    p = h.progress()
    assert p.state == "failed" and p.ready_bytes == 4 * sb and "out of locked memory" in p.error
    assert p.as_dict()["error"] == p.error and seen == [4, 4]
    assert "stopped growing" in caplog.text and "out of locked memory" in caplog.text
    h.slab_view(0).fill_(1)  # the chunks it has stay usable


def test_a_failed_background_allocation_names_the_size(monkeypatch):
    calls = []
    real = torch.empty

    def empty(*a, **k):
        calls.append(a)
        if len(calls) == 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(*a, **k)

    monkeypatch.setattr(host_slabs.torch, "empty", empty)
    h = HostSlabStorage(4096, 8, pin=False, chunk_bytes=4 * 4096, background=True)
    assert h.wait_ready(8, timeout=5) == 4
    h._thread.join(5)
    assert h.progress().state == "failed" and "cannot allocate the host cache" in h.error


def test_close_during_background_allocation_publishes_nothing_more(monkeypatch):
    import threading

    sb = 4096
    gates, _ = _gated_alloc(monkeypatch, 3)
    h = HostSlabStorage(sb, 12, pin=False, chunk_bytes=4 * sb, background=True)
    gates[0].set()
    assert h.wait_ready(4, timeout=5) == 4
    threading.Timer(0.2, gates[1].set).start()  # chunk 1 is being allocated while close() runs
    h.stop_growth()
    h._thread.join(5)
    assert not h._thread.is_alive() and h.ready_slabs == 4 and len(h.chunks) == 1
    assert h.progress().state == "stopped" and len(h.device_ptrs) == 1
