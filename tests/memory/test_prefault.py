"""The host tier's pages faulted in ahead of use on the CPU (hpc_cli.memory.prefault)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import time
import weakref

import pytest

from hpc_cli.cache.host import HostSlabPool, SlabUse
from hpc_cli.memory import prefault
from hpc_cli.memory.host_slabs import HostSlabStorage

pytestmark = pytest.mark.skipif(not prefault.supported(), reason="no madvise(MADV_POPULATE_WRITE) here")

MiB = 1 << 20


def resident_pages(address: int, nbytes: int) -> list[bool]:
    """Per page of ``[address, address + nbytes)`` (page aligned), whether it is in memory
    (``mincore``)."""
    page = prefault.PAGE
    assert address % page == 0 and nbytes % page == 0, "page-aligned ranges only"
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (nbytes // page))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_populate_write_faults_pages_in_and_keeps_their_bytes():
    page = prefault.PAGE
    mem = mmap.mmap(-1, 64 * page)  # fresh anonymous pages: none in memory yet
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    mem[:8] = bytes(range(8))  # page 0 written, the others untouched
    assert resident_pages(base, 64 * page) == [True] + [False] * 63
    assert prefault.populate_write(base + 5, 64 * page - 5)  # unaligned start: widened to the page
    assert all(resident_pages(base, 64 * page))
    assert mem[:8] == bytes(range(8)) and mem[8:] == bytes(64 * page - 8)


def test_the_cpu_tier_faults_in_what_use_is_about_to_reach(monkeypatch):
    monkeypatch.setattr(prefault, "PIECE_BYTES", MiB)
    slab = 64 << 10
    h = HostSlabStorage(slab, 1024, pin=False, background=True)  # 64 MiB of slabs
    try:
        assert h.wait_ready(1024, timeout=10) == 1024
        assert h._prefault is not None
        h._prefault.ahead_slabs = 128  # 8 MiB ahead
        chunk = h.chunks[0]
        page = prefault.PAGE
        base = chunk.data_ptr() + (-chunk.data_ptr()) % page
        skip = base - chunk.data_ptr()

        def resident_mib(lo: int, hi: int) -> float:
            a, b = base + lo * MiB, base + hi * MiB
            return sum(resident_pages(a, b - a)) * page / MiB

        assert resident_mib(0, 60) < 1  # nothing handed out yet, nothing asked for: nothing faulted
        h.fault_ahead(64)  # slabs below 64 (4 MiB) in use: fault in up to 12 MiB
        wait_for(lambda: h._prefault.faulted >= 192)
        assert resident_mib(0, 12) >= 12 - skip / MiB - 1e-9
        assert resident_mib(13, 60) < 1  # and no further
        h.fault_ahead(32)  # a lower mark never takes anything back
        assert h._prefault._target == 192
        h.fault_ahead(900)  # past the end: clamped to the slabs that exist
        wait_for(lambda: h._prefault.faulted >= 1024)
        assert resident_mib(0, 63) >= 63 - 1e-9
    finally:
        h.close()
    assert h._prefault is None


def test_pinned_or_foreground_storages_fault_nothing_ahead():
    h = HostSlabStorage(64 << 10, 16, pin=False)  # built in the foreground (tests, tools)
    assert h._prefault is None
    h.fault_ahead(8)  # a no-op
    h.close()


def test_the_pool_tracks_the_highest_slab_handed_out():
    pool = HostSlabPool(16 * 4096, 4096, 4096, ready_slabs=8)
    assert pool.high_water == 0
    a = pool.alloc(3, SlabUse.NODE, "a")
    assert a == [0, 1, 2] and pool.high_water == 3
    pool.free(a[:2])
    b = pool.alloc(2, SlabUse.NODE, "b")  # the freed ones again: no new slab
    assert sorted(b) == [0, 1] and pool.high_water == 3
    c = pool.alloc(3, SlabUse.IMAGE, "c")  # none free on top: new slabs 3, 4, 5
    assert sorted(c) == [3, 4, 5] and pool.high_water == 6
    pool.free([1])
    d = pool.alloc(2, SlabUse.NODE, "d")  # the freed slab 1 and the new slab 6
    assert sorted(d) == [1, 6] and pool.high_water == 7
    pool.grow(16)  # slabs that come later go under the free ones: the mark still counts up
    e = pool.alloc(2, SlabUse.NODE, "e")
    assert sorted(e) == [7, 8] and pool.high_water == 9
    pool.check()


def test_the_prefault_thread_ends_with_the_growth_and_never_keeps_its_storage():
    h = HostSlabStorage(64 << 10, 64, pin=False, background=True)
    th = h._prefault._thread
    h.fault_ahead(8)
    h.stop_growth()  # the engine stopped
    assert h._prefault is None
    th.join(5)
    assert not th.is_alive()
    h.close()

    h = HostSlabStorage(64 << 10, 64, pin=False, background=True)  # dropped without close()
    assert h.wait_ready(64, timeout=10) == 64
    pf = h._prefault  # holds the storage weakly
    h.fault_ahead(8)
    wait_for(lambda: pf.faulted >= 8)
    th = pf._thread
    gone = weakref.ref(h)
    del h
    gc.collect()
    assert gone() is None, "the thread kept the storage (and its memory) alive"
    th.join(5)
    assert not th.is_alive()
