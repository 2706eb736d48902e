"""PagedKVStorage through the KV dispatch: write/gather, slot skipping, counters, host slab copies."""

import pytest
import torch

from hpc_cli.kv_profile import KVProfile, PlaneSpec, RecordLayout
from hpc_cli.memory.kv_pool import PagedKVStorage
from kvtest_util import PROFILES, gaussian, gs_for

LAYERS, HEADS, D, PAGES = 2, 4, 256, 6


def _pool(name, device="cpu"):
    return PagedKVStorage(PROFILES[name], LAYERS, HEADS, D, PAGES, device=device)


@pytest.mark.parametrize("name", list(PROFILES))
def test_write_gather_matches_the_profile(name):
    prof = PROFILES[name]
    pool = _pool(name)
    k, v = gaussian(n=100, seed=11), gaussian(n=100, seed=12, scale=0.1)
    slots = torch.arange(100) + 64  # pages 1.. (first token at page 1 offset 0)
    pool.write(1, slots, k, v)
    kk, vv = pool.gather(1, [1, 2], 100, torch.bfloat16)
    for side, x, got in (("k", k, kk), ("v", v, vv)):
        gs = gs_for(prof, side)
        want = prof.dequantize(prof.quantize(x, side, gs), side, torch.bfloat16, gs)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert int(pool.nonfinite_counts.sum()) == 0


@pytest.mark.parametrize("name", ["int8-g64", "nvfp4-g16"])
def test_negative_slots_are_skipped_and_nonfinite_counted(name):
    pool = _pool(name)
    k = gaussian(n=4, seed=3).float()
    k[0, 0, 0] = float("nan")
    k[2, 1, 1] = float("inf")
    pool.write(0, torch.tensor([0, -1, 2, -1]), k, k)
    assert pool.nonfinite_counts[0].tolist() == [2, 2] and int(pool.nonfinite_counts[1].sum()) == 0
    for plane in pool.planes[0]:
        assert int(plane[0, 1].sum()) == 0 and int(plane[0, 3].sum()) == 0  # untouched
        assert int(plane[0, 0].sum()) > 0 and int(plane[0, 2].sum()) > 0
    kk, _ = pool.gather(0, [0], 3, torch.float32)
    assert torch.isfinite(kk).all() and kk[0, 0, 0] == 0


def _pack(pool, page):
    """A host slab record: the page's planes back to back, layer by layer (spec §11.2)."""
    return torch.cat([plane[page].reshape(-1) for layer in pool.planes for plane in layer])


def _unpack(pool, page, slab):
    off = 0
    for layer in pool.planes:
        for plane in layer:
            n = plane[page].numel()
            plane[page].view(-1).copy_(slab[off:off + n])
            off += n
    assert off == slab.numel()


@pytest.mark.parametrize("name", list(PROFILES))
def test_page_device_to_host_slab_to_device_is_bit_exact(name):
    src, dst = _pool(name), _pool(name)
    for layer in range(LAYERS):
        src.write(layer, torch.arange(64 * 3), gaussian(n=192, seed=layer), gaussian(n=192, seed=9 + layer))
    geo = PROFILES[name].page_geometry(D, HEADS, LAYERS)
    slab = torch.zeros(geo.slab_bytes(), dtype=torch.uint8)
    rec = _pack(src, 2)
    assert rec.numel() == geo.page_bytes == src.page_bytes
    slab[:rec.numel()] = rec
    _unpack(dst, 5, slab[:geo.page_bytes].clone())
    for la, lb in zip(src.planes, dst.planes):
        for pa, pb in zip(la, lb):
            assert torch.equal(pa[2], pb[5])
    for layer in range(LAYERS):
        a = src.gather(layer, [2], 64, torch.float32)
        b = dst.gather(layer, [5], 64, torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _ThirdPartyProfile(KVProfile):
    """A profile without side formats: the pool's generic path."""

    name = "fp32-test"

    def layout(self, head_dim):
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", 4 * head_dim), PlaneSpec("v_data", "v", 4 * head_dim)))

    def quantize(self, x, side, global_scale=None):
        n, h, d = x.shape
        return [x.float().contiguous().view(torch.uint8).view(n, h, 4 * d)]

    def dequantize(self, planes, side, dtype, global_scale=None):
        (p,) = planes
        n, h, b = p.shape
        return p.contiguous().view(torch.float32).view(n, h, b // 4).to(dtype)


def test_third_party_profiles_keep_the_generic_path():
    pool = PagedKVStorage(_ThirdPartyProfile(), 1, HEADS, 64, 2)
    k = torch.randn(70, HEADS, 64)
    pool.write(0, torch.arange(70), k, -k)
    kk, vv = pool.gather(0, [0, 1], 70, torch.float32)
    assert torch.equal(kk, k) and torch.equal(vv, -k)


def test_set_global_scale():
    pool = _pool("nvfp4-g16")
    assert pool.global_scales[0].tolist() == [0.25, 0.0625]
    pool.set_global_scale(1, "v", 0.5)
    assert pool.global_scales[1, 1] == 0.5
    with pytest.raises(AssertionError):
        pool.set_global_scale(0, "k", float("nan"))
