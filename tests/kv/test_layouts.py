import pytest

from hpc_cli.errors import ConfigError
from hpc_kernels.kv_quant_ref import SideFormat

from kvtest_util import PROFILES


@pytest.mark.parametrize("name,total,k,v", [
    ("bf16", 1024, 512, 512), ("int8-g64", 528, 264, 264), ("fp8-e4m3fn-row256", 516, 258, 258),
    ("nvfp4-g16", 288, 144, 144), ("k8v4", 402, 258, 144)])
def test_record_bytes_head_dim_256(name, total, k, v):
    lay = PROFILES[name].layout(256)
    assert (lay.bytes_per_token_head, lay.k_bytes, lay.v_bytes) == (total, k, v)
    # data planes first on each side, so data rows stay 16-byte aligned
    for side in ("k", "v"):
        data = lay.side_planes(side)[0]
        assert data.name == f"{side}_data" and data.bytes_per_token_head % 16 == 0


@pytest.mark.parametrize("name,plane_bytes", [
    ("bf16", [256, 256]), ("int8-g64", [128, 4, 128, 4]), ("fp8-e4m3fn-row256", [128, 2, 128, 2]),
    ("nvfp4-g16", [64, 8, 64, 8]), ("k8v4", [128, 2, 64, 8])])
def test_record_bytes_head_dim_128(name, plane_bytes):
    assert [p.bytes_per_token_head for p in PROFILES[name].layout(128).planes] == plane_bytes


def test_side_formats_match_layout():
    for prof in PROFILES.values():
        for hd in (128, 256, 512):
            lay = prof.layout(hd)
            for side in ("k", "v"):
                fmt = prof.side_format(side, hd)
                assert isinstance(fmt, SideFormat)
                assert [p.bytes_per_token_head for p in lay.side_planes(side)] == list(fmt.plane_bytes(hd))


def test_head_dim_512_has_two_rows():
    assert PROFILES["fp8-e4m3fn-row256"].side_format("k", 512).group == 256
    assert PROFILES["k8v4"].layout(512).k_bytes == 512 + 4


def test_bad_head_dim_is_a_config_error():
    with pytest.raises(ConfigError):
        PROFILES["int8-g64"].layout(96)
    with pytest.raises(ConfigError):
        PROFILES["nvfp4-g16"].layout(72)


def test_page_geometry_and_slab_rounding():
    # 27B: 16 attention layers x 4 KV heads
    geo = PROFILES["int8-g64"].page_geometry(256, kv_heads=4, layers=16)
    assert geo.plane_names == ("k_data", "k_scale", "v_data", "v_scale")
    assert geo.plane_page_bytes == (64 * 4 * 256, 64 * 4 * 8, 64 * 4 * 256, 64 * 4 * 8)
    assert geo.page_bytes == 528 * 64 * 4 * 16 == 2_162_688  # 2.06 MiB (spec §3.1)
    assert geo.plane_offset(1, 2) == sum(geo.plane_page_bytes) + 64 * 4 * 264
    assert geo.slab_bytes() == geo.page_bytes  # already a multiple of 4 KiB
    # MTP-like backend page: starts at the next 4 KiB boundary, whole slab rounded up
    assert geo.slab_bytes(backend_page_bytes=100) == geo.page_bytes + 4096
    nv = PROFILES["k8v4"].page_geometry(256, kv_heads=2, layers=10)
    assert nv.page_bytes == 402 * 64 * 2 * 10
    assert nv.slab_bytes() % 4096 == 0 and 0 <= nv.slab_bytes() - nv.page_bytes < 4096
    assert nv.slab_bytes(1000) == -(-nv.page_bytes // 4096) * 4096 + 4096
