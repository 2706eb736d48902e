"""Round-trip error bounds (a little above what was measured), determinism, and format policy."""

import pytest
import torch

from hpc_kernels import kv_quant_ref as ref
from hpc_kernels.kv_quant_ref import SideFormat
from hpc_plugins.kv_profiles import NVFP4_DEFAULT_GLOBAL_SCALE, nvfp4_global_scale_for_amax
from kvtest_util import PROFILES, gaussian, gs_for, outlier_channels, rel_err

# (profile, side) -> (bound on Gaussian data, bound on outlier-channel data): relative Frobenius
# error. Measured (bf16 input, 512 tokens x 4 heads x 256): int8-g64 0.0059 / 0.0152,
# fp8 0.0261 / 0.0191, nvfp4 0.0952 / 0.0823, k8v4 K 0.0070 / 0.0252.
BOUNDS = {
    "bf16": {"k": (0.0, 0.0), "v": (0.0, 0.0)},
    "int8-g64": {"k": (0.0065, 0.017), "v": (0.0065, 0.017)},
    "fp8-e4m3fn-row256": {"k": (0.029, 0.022), "v": (0.029, 0.022)},
    "nvfp4-g16": {"k": (0.105, 0.091), "v": (0.105, 0.091)},
    "k8v4": {"k": (0.0077, 0.028), "v": (0.105, 0.091)},
}


def _roundtrip(prof, side, x, dtype=torch.float32):
    gs = gs_for(prof, side)
    return prof.dequantize(prof.quantize(x, side, gs), side, dtype, gs)


@pytest.mark.parametrize("name", list(PROFILES))
@pytest.mark.parametrize("side", ["k", "v"])
def test_roundtrip_error_bounds(name, side):
    prof = PROFILES[name]
    g_bound, o_bound = BOUNDS[name][side]
    for scale in (1.0, 0.05, 20.0):
        x = gaussian(scale=scale)
        assert rel_err(_roundtrip(prof, side, x), x) <= g_bound
    x, _ = outlier_channels()
    assert rel_err(_roundtrip(prof, side, x), x) <= o_bound


@pytest.mark.parametrize("name", list(PROFILES))
def test_quantize_is_deterministic_and_row_local(name):
    prof = PROFILES[name]
    x = gaussian(n=64, seed=7)
    for side in ("k", "v"):
        a = prof.quantize(x, side, gs_for(prof, side))
        b = prof.quantize(x.clone(), side, gs_for(prof, side))
        assert all(torch.equal(p, q) for p, q in zip(a, b))
        # a token's bytes do not depend on what else is in the batch
        c = prof.quantize(x[10:20], side, gs_for(prof, side))
        assert all(torch.equal(p[10:20], q) for p, q in zip(a, c))
        # fp32 and bf16 inputs of the same values give the same bytes
        d = prof.quantize(x.float(), side, gs_for(prof, side))
        assert all(torch.equal(p, q) for p, q in zip(a, d))


def test_bf16_is_byte_exact():
    x = gaussian(n=16)
    (data,) = PROFILES["bf16"].quantize(x, "k")
    assert torch.equal(data.view(torch.bfloat16).reshape(x.shape).view(torch.int16), x.view(torch.int16))


def test_int8_codes_use_the_stored_scale():
    x = torch.zeros(1, 1, 64)
    x[0, 0, 0] = 1.0  # amax 1: s = fp16(1/127) differs from 1/127
    x[0, 0, 1:] = (torch.arange(60, 123) + 0.5) / 127  # ties under the unrounded scale
    data, scale = ref.quantize_int8(x, 64)
    s16 = torch.tensor(1.0 / 127).to(torch.float16)
    assert scale.view(torch.float16)[0, 0, 0] == s16 and s16.float() != torch.tensor(1.0 / 127)
    q = data.view(torch.int8)[0, 0].float()
    assert torch.equal(q, torch.clamp(torch.round(x[0, 0] / s16.float()), -127, 127))
    # with the unrounded scale some codes would differ: the test really tells the rules apart
    assert not torch.equal(q, torch.round(x[0, 0] * 127.0))


def test_int8_round_half_even():
    x = torch.zeros(1, 1, 64)
    x[0, 0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale exactly 1
    q = ref.quantize_int8(x, 64)[0].view(torch.int8)[0, 0, :6]
    assert q.tolist() == [127, 0, 2, 2, 0, -2]


def test_e4m3_arithmetic_twin_matches_torch():
    # every E4M3 value, every midpoint between neighbours, and one fp32 ulp either side of it
    vals = ref.e4m3_decode(torch.arange(0, 127, dtype=torch.uint8)).sort().values  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    dn = torch.nextafter(mids, torch.zeros_like(mids))
    g = torch.Generator().manual_seed(3)
    rnd = torch.exp2(torch.rand(200_000, generator=g) * 22 - 13)  # 2^-13 .. 2^9
    v = torch.cat([vals, mids, up, dn, rnd.clamp(max=448.0), torch.tensor([0.0, 1e-30])])
    v = torch.cat([v, -v])
    assert torch.equal(ref.e4m3_round_arith(v), ref.e4m3_round(v))


def test_e2m1_round_is_nearest_even():
    table = torch.tensor(ref.E2M1_VALUES)
    v = torch.linspace(-6, 6, 48001)  # includes every midpoint exactly
    codes = ref.e2m1_round(v)
    got = ref.e2m1_decode(codes)
    dist = (v.abs()[:, None] - table[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.equal((got.abs() - v.abs()).abs(), best)  # nearest
    tie = (dist == best[:, None]).sum(1) > 1
    assert tie.sum() > 0 and ((codes[tie] & 1) == 0).all()  # ties to the even code
    assert (codes[v == 0] == 0).all()


def test_zero_groups_and_negative_zero_are_canonical():
    x = torch.zeros(2, 1, 256)
    x[1] = -0.0
    for name in ("int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"):
        prof = PROFILES[name]
        for side in ("k", "v"):
            planes = prof.quantize(x, side, gs_for(prof, side))
            assert all(int(p.sum()) == 0 for p in planes), (name, side)  # zero scale, +0 codes
            y = prof.dequantize(planes, side, torch.float32, gs_for(prof, side))
            assert torch.equal(y, torch.zeros_like(y)) and not torch.signbit(y).any()
    # a -0 among non-zeros is stored as +0 too
    x = gaussian(n=1, h=1)
    x[0, 0, 5] = -0.0
    assert ref.quantize_fp8(x, 256)[0][0, 0, 5] == 0
    assert ref.quantize_nvfp4(x, 1.0)[0][0, 0, 2] >> 4 == 0  # element 5: high nibble of byte 2


@pytest.mark.parametrize("name", list(PROFILES))
def test_non_finite_never_becomes_nan(name):
    prof = PROFILES[name]
    x = gaussian(n=4, h=2).float()
    x[0, 0, 3] = float("nan")
    x[1, 0, 100] = float("inf")
    x[2, 1, 200] = float("-inf")
    x[3, 1, :] = float("nan")  # a whole NaN row
    for side in ("k", "v"):
        y = _roundtrip(prof, side, x)
        assert torch.isfinite(y).all()
        assert y[0, 0, 3] == 0 and (y[3, 1] == 0).all()
        fmt = prof.side_format(side, 256)
        top = 6 * 448 * gs_for(prof, side) if fmt.kind == "nvfp4" else 1e4
        assert y[1, 0, 100] >= 0.99 * top and y[2, 1, 200] <= -0.99 * top  # saturated, sign kept
        # rows without a non-finite value are untouched by the policy
        clean = _roundtrip(prof, side, x[1:2, 1:2])
        assert torch.equal(clean, y[1:2, 1:2])
    assert int(ref.count_nonfinite(x)) == 3 + 256


def test_nvfp4_default_global_scales_keep_typical_blocks_nonzero():
    for side, gs in NVFP4_DEFAULT_GLOBAL_SCALE.items():
        for std in (0.01, 0.1, 1.0, 10.0):
            x = gaussian(n=256, scale=std)
            _, scales = ref.quantize_nvfp4(x, gs)
            assert (scales != 0).all(), (side, std)
            # and none saturates
            assert (scales < 0x7E).all(), (side, std)


def test_nvfp4_global_scale_calibration():
    for amax in (0.3, 5.0, 1234.0):
        g = nvfp4_global_scale_for_amax(amax)
        assert amax <= 6 * 448 * g < 2 * amax and g == 2.0 ** round(torch.log2(torch.tensor(g)).item())
    x = gaussian(n=64, scale=300.0)
    g = nvfp4_global_scale_for_amax(float(x.float().abs().max()))
    y = ref.dequantize_nvfp4(ref.quantize_nvfp4(x, g), torch.float32, g)
    assert rel_err(y, x) < 0.105


def test_nvfp4_nibble_order():
    x = torch.zeros(1, 1, 16)
    x[0, 0, 0], x[0, 0, 1] = 6.0, -3.0  # block amax 6 -> block scale 1 with gs = 1
    data, scale = ref.quantize_nvfp4(x, 1.0)
    assert ref.e4m3_decode(scale)[0, 0, 0] == 1.0
    assert data[0, 0, 0] == (0x7 | (0xD << 4))  # low nibble = element 0 (6.0), high = element 1 (-3.0)


def test_side_format_plane_bytes():
    assert SideFormat("int8", 64).plane_bytes(256) == (256, 8)
    assert SideFormat("nvfp4", 16).plane_bytes(256) == (128, 16)
