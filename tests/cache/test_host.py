"""§13.1 HostSlabPool."""

import pytest

from hpc_cli.cache import HostSlabPool, SlabUse, image_slabs
from hpc_cli.errors import CapacityError


def test_slab_pool_exhaustion_reuse_and_chunked_allocation():
    pool = HostSlabPool(10 * 4096, 4096, 3 * 4096, chunk_bytes=4 * 4096)
    assert pool.num_slabs == 10 and pool.num_chunks == 3
    assert pool.chunk_sizes() == [4 * 4096, 4 * 4096, 2 * 4096]
    got = pool.alloc(7, SlabUse.NODE, "a")
    assert got == list(range(7)) and pool.free_slabs == 3
    assert pool.alloc(4, SlabUse.NODE, "b") is None and pool.free_slabs == 3  # nothing taken
    rest = pool.alloc(3, SlabUse.IMAGE, "c")
    assert pool.free_slabs == 0 and pool.alloc(1, SlabUse.NODE, "d") is None
    pool.free(got[2:4])
    again = pool.alloc(2, SlabUse.TAIL, "e")
    assert sorted(again) == [2, 3] and pool.owner_of(2) == "e" and pool.use_of(3) == SlabUse.TAIL
    pool.check()
    with pytest.raises(AssertionError):
        pool.free([rest[0], rest[0]])


def test_a_slab_never_crosses_chunks():
    slab = 3 * 4096 + 512
    pool = HostSlabPool(100 * slab, slab, 2 * slab, chunk_bytes=16 * 4096)
    assert pool.slabs_per_chunk == (16 * 4096) // slab
    for s in range(pool.num_slabs):
        c, off = pool.location(s)
        assert off + slab <= 16 * 4096, f"slab {s} crosses chunk {c}"
        assert c == s // pool.slabs_per_chunk
    assert sum(pool.chunk_sizes()) == pool.num_slabs * slab
    assert pool.same_chunk(0, pool.slabs_per_chunk - 1) and not pool.same_chunk(0, pool.slabs_per_chunk)


def test_budget_smaller_than_one_snapshot_plus_one_block_is_rejected():
    assert image_slabs(10000, 4096) == 3
    with pytest.raises(CapacityError) as e:
        HostSlabPool(3 * 4096, 4096, 10000)  # 3 slabs < 3 + 1
    assert "snapshot" in e.value.message and "--host-cache-mib" in e.value.hint
    ok = HostSlabPool(4 * 4096, 4096, 10000)
    assert ok.num_slabs == 4
    off = HostSlabPool(0, 4096, 10000)  # 0 disables the host tier
    assert not off.enabled and off.alloc(1, SlabUse.NODE, "x") is None


def test_pool_hands_out_only_ready_slabs_first_slabs_first():
    """A tier pinned in the background: the free list grows as chunks are ready, under the
    slabs already free, so a fresh pool still goes 0, 1, 2, ...; per-use counts follow."""
    pool = HostSlabPool(10 * 4096, 4096, 3 * 4096, chunk_bytes=4 * 4096, ready_slabs=0)
    assert pool.num_slabs == 10 and pool.ready_slabs == 0 and pool.free_slabs == 0 and pool.enabled
    assert pool.alloc(1, SlabUse.NODE, "a") is None and pool.slabs_by_use() == {}
    assert pool.grow(4) == 4 and pool.pending_slabs == 6
    a = pool.alloc(3, SlabUse.NODE, "a")
    assert a == [0, 1, 2] and pool.alloc(2, SlabUse.IMAGE, "b") is None
    pool.free([1])
    assert pool.grow(8) == 4 and pool.grow(5) == 0  # never shrinks
    got = pool.alloc(6, SlabUse.IMAGE, "c")
    assert got == [1, 3, 4, 5, 6, 7] and pool.free_slabs == 0
    pool.set_use(7, SlabUse.TAIL)
    assert pool.slabs_by_use() == {"node": 2, "image": 5, "tail": 1} == pool.recount_by_use()
    pool.check()
    assert pool.grow(99) == 2 and pool.ready_slabs == 10 and pool.alloc(2, SlabUse.NODE, "d") == [8, 9]
    pool.check()
