"""ExpertCache: residency table bounds, admission without eviction, per-layer ranges, fills, verify."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.errors import CapacityError, EngineError
from hpc_cli.experts.cache import NOT_RESIDENT, ExpertCache, ExpertCacheError
from hpc_cli.experts.tier import ExpertTier

from .helpers import tiny_moe


def _cache(slots=10, layers=4, experts=8, blob=100, per_layer=False):
    c = ExpertCache("cpu")
    c.open(slots, layers, experts, blob)
    c.set_per_layer_admission(per_layer)
    return c


def test_residency_table_bounds():
    c = _cache()
    assert c.slot_of(0, 0) == NOT_RESIDENT and c.slot_of(3, 7) == NOT_RESIDENT
    for layer, expert in [(-1, 0), (4, 0), (0, -1), (0, 8), (99, 99)]:
        with pytest.raises(ExpertCacheError, match="outside"):
            c.slot_of(layer, expert)
        with pytest.raises(ExpertCacheError, match="outside"):
            c.admit(layer, expert)
    for slot in (-1, 10):
        with pytest.raises(ExpertCacheError, match="slot .* outside"):
            c.device_slot(slot)
        with pytest.raises(ExpertCacheError, match="outside"):
            c.fill_slot(slot, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ExpertCacheError, match="not open"):
        ExpertCache().slot_of(0, 0)


def test_admission_never_evicts_and_is_idempotent():
    c = _cache(slots=3)
    assert [c.admit(0, 1), c.admit(2, 5), c.admit(0, 1), c.admit(3, 3)] == [0, 1, 0, 2]
    assert c.admit(1, 1) == NOT_RESIDENT  # full: nothing is evicted
    assert (c.slot_of(0, 1), c.slot_of(2, 5), c.slot_of(3, 3), c.slot_of(1, 1)) == (0, 1, 2, NOT_RESIDENT)
    assert c.resident == 3 and c.slots == 3


@pytest.mark.parametrize("slots,layers", [(10, 4), (8, 4), (3, 4), (17, 5)])
def test_per_layer_ranges_remainder_to_last(slots, layers):
    c = _cache(slots=slots, layers=layers, per_layer=True)
    q = slots // layers
    ranges = [c.layer_slot_range(layer) for layer in range(layers)]
    assert ranges[0][0] == 0 and ranges[-1][1] == slots
    for layer, (lo, hi) in enumerate(ranges):
        assert lo == layer * q
        assert hi - lo == (q if layer < layers - 1 else slots - q * (layers - 1))
        if layer:
            assert lo == ranges[layer - 1][1]
    with pytest.raises(ExpertCacheError):
        c.layer_slot_range(layers)
    # each layer admits exactly its range, into its range
    for layer, (lo, hi) in enumerate(ranges):
        got = [c.admit(layer, e) for e in range(8)]
        taken = [s for s in got if s != NOT_RESIDENT]
        assert taken == list(range(lo, hi))


def test_per_layer_admission_differs_from_global():
    g, p = _cache(slots=8), _cache(slots=8, per_layer=True)
    for e in range(8):
        g.admit(0, e)
        p.admit(0, e)
    assert (g.table[0] != NOT_RESIDENT).sum() == 8
    assert (p.table[0] != NOT_RESIDENT).sum() == 2 and p.admit(1, 0) == 2


def test_sized_slots_and_capacity_check():
    c = ExpertCache("cpu")
    c.open_sized([100, 100, 300], 2, 4)
    assert c.slot_offsets() is not None and c.bytes == 256 + 256 + 512
    assert c.device_slot(2).numel() == 300
    c.admit(0, 0, blob_bytes=100)
    c.admit(0, 1, blob_bytes=100)
    assert c.admit(1, 0, blob_bytes=300) == 2
    d = ExpertCache("cpu")
    d.open_sized([100, 100], 2, 4)
    d.admit(0, 0)
    with pytest.raises(ExpertCacheError, match="holds"):
        d.admit(1, 0, blob_bytes=200)
    with pytest.raises(CapacityError, match="free"):
        ExpertCache("cpu").open(1000, 4, 8, 1 << 20, free_bytes=10 << 20)


def test_fill_and_verify_catch_a_corrupted_slot():
    c = _cache(slots=2, blob=64)
    blob = torch.arange(64, dtype=torch.uint8)
    s = c.admit(1, 2)
    assert c.fill_slot(s, blob) is None  # CPU: done on return
    assert c.verify_slot(s, blob) is None
    c.device_slot(s)[37] ^= 0xFF
    err = c.verify_slot(s, blob)
    assert err is not None and "slot 0 (layer 1, expert 2)" in err and "byte 37" in err
    c.fill_slot_blocking(s, blob)
    assert c.verify_slot(s, blob) is None and c.fills == 2
    with pytest.raises(ExpertCacheError, match="do not fit"):
        c.fill_slot(s, torch.zeros(200, dtype=torch.uint8), nbytes=200)


def test_startup_verification_refuses_a_bad_slot():
    m = tiny_moe()
    tier = ExpertTier(m, slots=6, admission="per-layer-first-routed")
    m.forward_tokens([1, 2, 3, 4])
    tier.verify_all()
    slot = next(i for i, o in enumerate(tier.cache.owner) if o is not None)
    tier.cache.device_slot(slot)[5] ^= 1
    with pytest.raises(EngineError, match="verification failed.*differs from the host copy"):
        tier.verify_all()


def test_tier_rejects_a_dense_model_and_a_missing_profile():
    from hpc_cli.errors import ConfigError
    from hpc_cli.model.model import HybridModel

    with pytest.raises(ConfigError, match="no MoE layers"):
        ExpertTier(HybridModel.from_name_or_path("builtin:random"), slots=1, admission="first-routed")
    with pytest.raises(ConfigError, match="needs a profile"):
        ExpertTier(tiny_moe(), slots=1, admission="profile")
