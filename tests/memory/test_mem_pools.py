"""Device page and state slot accounting (spec §5.4)."""

from __future__ import annotations

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.errors import CapacityError
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.pools import DeviceKVPool, PageState, PoolCounts
from hpc_cli.memory.state_pool import StateSlots


def _pool(n=8, evictable=None):
    storage = PagedKVStorage(plugins.kv_profile("bf16"), 2, 2, 16, n)
    return DeviceKVPool(storage, evictable)


def test_alloc_states_counts_and_available():
    cached_evictable = {"n": 0}
    pool = _pool(8, lambda: cached_evictable["n"])
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_active == 3 and pool.num_free == 5
    f = pool.alloc(2, PageState.FILLING)
    assert [pool.state(p) for p in f] == [PageState.FILLING] * 2
    pool.set_state(a[:2], PageState.CACHED)  # block commit adopts the pages
    pool.land(f)  # restore landed
    assert pool.counts() == PoolCounts(free=3, active=1, cached=4, filling=0)
    assert pool.available == 3
    cached_evictable["n"] = 4
    assert pool.available == 7
    pool.check_invariants()


def test_exhaustion_and_try_alloc():
    pool = _pool(4)
    pool.alloc(3)
    assert pool.try_alloc(2) is None and pool.num_free == 1  # nothing taken
    with pytest.raises(CapacityError, match="1 free pages of 4, 2 needed"):
        pool.alloc(2)
    pool.alloc(1)
    assert pool.available == 0
    pool.check_invariants()


def test_free_rules():
    pool = _pool(4)
    a = pool.alloc(2, PageState.FILLING)
    with pytest.raises(AssertionError, match="Filling"):
        pool.free(a[:1])
    pool.free(a[:1], abandon_filling=True)  # a failed restore returns its destination
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(a[:1])
    with pytest.raises(AssertionError):
        pool.set_state(a[1:], PageState.ACTIVE)  # Filling -> Active is not a thing
    pool.land(a[1:])
    pool.free(a[1:])
    assert pool.num_free == 4
    # freed ids are reused, lowest stack top first
    assert pool.alloc(1) == [a[1]]
    pool.check_invariants()


def test_evictable_callback_is_checked():
    pool = _pool(4, lambda: 3)
    pool.alloc(1, PageState.CACHED)
    with pytest.raises(AssertionError, match="evictable"):
        _ = pool.available


def _slots(n, **kw):
    return StateSlots(3, 8, 3, 2, 4, 4, 16, n, dtype=torch.bfloat16, **kw)


def test_tap_copies_the_whole_image_and_only_it():
    slots = _slots(4, extra_parts={"ring": ((2, 5), torch.bfloat16)})
    for t in slots.parts():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    before = [t.clone() for t in slots.parts()]
    slots.copy_slot(0, 2)
    slots.copy_slot(0, 3, "per_layer")
    for t, b in zip(slots.parts(), before):
        assert torch.equal(t[3], b[0])
        assert torch.equal(t[2], b[0])
        assert torch.equal(t[1], b[1])
    slots.reset(2)
    assert all(not t[2].any() for t in slots.parts())
    # per-layer views stay contiguous and alias the stacked storage
    assert all(c.is_contiguous() and r.is_contiguous() for c, r in zip(slots.conv, slots.recurrent))
    slots.recurrent[1][3].fill_(7)
    assert slots.recurrent_all[1, 3].eq(7).all()


def test_image_bytes_match_shape_preset():
    from hpc_cli.shapes import preset

    shape = preset("qwen3.5-35b-a3b")
    slots = StateSlots(shape.num_gdn_layers, shape.conv_dim, shape.linear_conv_kernel_dim - 1,
                       shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim,
                       shape.hidden_size, 1, dtype=torch.bfloat16)
    assert slots.image_bytes == shape.state_image_bytes()
    assert [n for n, _, _ in slots.image_parts()][:3] == ["conv0", "recurrent0", "conv1"]
