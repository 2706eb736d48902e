"""Triton kernels against the torch reference (CUDA only): identical codes, identical values.

The kernels compute the reference's quotient exactly (a div_rn per value, or the fast path's
reciprocal with one or two remainder corrections) and round half to even exactly, so no tie case is
expected to differ; every mismatch is counted and reported, and the allowance is zero.
"""

import pytest
import torch

from hpc_kernels import kv_quant, kv_quant_ref as ref
from hpc_cli.memory.kv_pool import PagedKVStorage
from kvtest_util import PROFILES, gaussian, gs_for, outlier_channels, special_values, tie_data

pytestmark = pytest.mark.gpu
ALLOWED_TIE_MISMATCHES = 0


def _special(n=300, h=4, d=256):
    x = gaussian(n=n, h=h, d=d, seed=21).float()
    x[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30])
    x[1] = 0.0
    x[2] = -0.0
    x[3] *= 1e-6  # underflowing scales
    x[4] *= 1e4
    x[5, :, ::2] = 0.5  # exact ties for many scales
    x[6] = torch.randint(-127, 128, (h, d)).float()  # int8 scale exactly 1
    return x


def _inputs():
    o, _ = outlier_channels(n=300)
    return {"gauss": gaussian(n=300), "outliers": o, "special": _special(), "special_bf16": _special().to(torch.bfloat16)}


@pytest.fixture(params=["auto", False], ids=["hw_fp8", "sw_fp8"])
def hw_fp8(request):
    """kv_quant_triton.CONFIG["hw_fp8"]: E4M3 by the GPU's conversion (sm_89+) or by arithmetic."""
    from hpc_kernels import kv_quant_triton as kt

    old = kt.CONFIG["hw_fp8"]
    kt.CONFIG["hw_fp8"] = request.param
    yield request.param
    kt.CONFIG["hw_fp8"] = old


@pytest.mark.parametrize("name", list(PROFILES))
def test_triton_codes_and_values_match_reference(name, hw_fp8):
    prof = PROFILES[name]
    for label, x in _inputs().items():
        for side in ("k", "v"):
            fmt = prof.side_format(side, 256)
            assert kv_quant.use_triton(fmt, torch.device("cuda"), 256)
            gs = gs_for(prof, side)
            want = ref.quantize(fmt, x, gs)
            n = x.shape[0]
            planes = [torch.zeros(n + 64, x.shape[1], b, dtype=torch.uint8, device="cuda") for b in fmt.plane_bytes(256)]
            slots = torch.randperm(n + 64, device="cuda")[:n]
            counter = torch.zeros((), dtype=torch.int32, device="cuda")
            kv_quant.quantize_into(fmt, x.cuda(), slots, planes, gs, counter)
            got = [p[slots].cpu() for p in planes]
            mism = sum(int((a != b).sum()) for a, b in zip(got, want))
            print(f"{name} {side} {label}: {mism} code mismatches")
            assert mism <= ALLOWED_TIE_MISMATCHES, (name, side, label)
            assert int(counter) == int(ref.count_nonfinite(x))
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                out = kv_quant.dequantize_slots(fmt, planes, slots, 256, dtype, gs).cpu()
                exp = ref.dequantize(fmt, want, dtype, gs)
                assert torch.equal(out, exp) or torch.equal(out.view(torch.uint8), exp.view(torch.uint8)), (name, side, label, dtype)
                if dtype != torch.float16:
                    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(PROFILES))
def test_cuda_pool_bytes_equal_cpu_pool_and_survive_a_host_copy(name):
    cpu = PagedKVStorage(PROFILES[name], 2, 4, 256, 5)
    gpu = PagedKVStorage(PROFILES[name], 2, 4, 256, 5, device="cuda")
    k, v = gaussian(n=200, seed=5), gaussian(n=200, seed=6, scale=0.1)
    slots = torch.arange(200) + 40
    for pool in (cpu, gpu):
        pool.write(1, slots.to(pool.device), k.to(pool.device), v.to(pool.device))
    for la, lb in zip(cpu.planes, gpu.planes):
        for pa, pb in zip(la, lb):
            assert torch.equal(pa, pb.cpu())
    # device -> pinned host slab -> another device page: bit-exact
    slab = torch.cat([p[2].reshape(-1) for layer in gpu.planes for p in layer]).cpu().pin_memory()
    off = 0
    for layer in gpu.planes:
        for p in layer:
            n = p[4].numel()
            p[4].view(-1).copy_(slab[off:off + n].to("cuda", non_blocking=True))
            off += n
    torch.cuda.synchronize()
    for layer in gpu.planes:
        for p in layer:
            assert torch.equal(p[2], p[4])
    a = gpu.gather(1, [2], 64, torch.bfloat16)
    b = cpu.gather(1, [2], 64, torch.bfloat16)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b))


def _triton_codes(fmt, x, gs, fast: bool):
    """quantize_into through the Triton kernels with CONFIG["fast_div"] = fast: (planes at the
    written slots, non-finite count)."""
    from hpc_kernels import kv_quant_triton as kt

    n = x.shape[0]
    planes = [torch.zeros(n + 64, x.shape[1], b, dtype=torch.uint8, device="cuda") for b in fmt.plane_bytes(256)]
    slots = torch.randperm(n + 64, device="cuda")[:n]
    counter = torch.zeros((), dtype=torch.int32, device="cuda")
    old = kt.CONFIG["fast_div"]
    kt.CONFIG["fast_div"] = fast
    try:
        kv_quant.quantize_into(fmt, x.cuda(), slots, planes, gs, counter)
    finally:
        kt.CONFIG["fast_div"] = old
    return [p[slots].cpu() for p in planes], int(counter)


@pytest.mark.parametrize("name", [n for n in PROFILES if n != "bf16"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast_div", "exact_div"])
def test_both_division_paths_match_reference_on_ties(name, fast):
    """Exact ties (x / s a grid midpoint), values one ulp off them, and special values, in fp32
    and bf16, on the fast (reciprocal quotient) and the exact (div_rn per value) path."""
    prof = PROFILES[name]
    for side in ("k", "v"):
        fmt = prof.side_format(side, 256)
        gss = [gs_for(prof, side)]
        if fmt.kind == "nvfp4":
            gss += [float(torch.tensor(0.3)), 2.0 ** -140, 2.0 ** 118]
        for gs in gss:
            data = {"ties": tie_data(fmt, gs, n=256), "near_ties": tie_data(fmt, gs, n=256, seed=4, nudge=True),
                    "special": special_values(n=64), "gauss_bf16": gaussian(n=256, seed=8)}
            data["ties_bf16"] = data["ties"].to(torch.bfloat16)
            for label, x in data.items():
                got, count = _triton_codes(fmt, x, gs, fast)
                want = ref.quantize(fmt, x, gs)
                mism = sum(int((a != b).sum()) for a, b in zip(got, want))
                assert mism == 0, (name, side, gs, label, fast, mism)
                assert count == int(ref.count_nonfinite(x)), (name, side, gs, label, fast)


@pytest.mark.parametrize("name", [n for n in PROFILES if n != "bf16"])
def test_fast_quotient_matches_reference_on_millions_of_near_ties(name):
    """The fast path at scale, against the reference (on the CPU, the reference's home): for
    each side, 16 batches of 2048 tokens x 4 heads x 256 (33.5M values): exact ties, values
    one ulp off, and Gaussian data over 40 binades of magnitude, in fp32 and bf16."""
    prof = PROFILES[name]
    for side in ("k", "v"):
        fmt = prof.side_format(side, 256)
        gs = gs_for(prof, side)
        total = 0
        for seed in range(16):
            x = tie_data(fmt, gs, n=2048, seed=100 + seed, nudge=seed % 2 == 1)
            if seed % 4 == 2:
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(2048, 4, 256, generator=g) * torch.exp2(torch.randint(-20, 21, (2048, 4, 1), generator=g).float())
            if seed % 4 == 3:
                x = x.to(torch.bfloat16)
            got, count = _triton_codes(fmt, x, gs, True)
            want = ref.quantize(fmt, x, gs)
            mism = sum(int((a != b).sum()) for a, b in zip(got, want))
            assert mism == 0, (name, side, seed, mism)
            total += x.numel()
        assert total == 16 * 2048 * 4 * 256


def test_write_is_capture_safe():
    """A CUDA graph of a k8v4 write (int8 K, NVFP4 V) replays with new input to the reference's
    bytes and count."""
    prof = PROFILES["k8v4"]
    n = 256
    x = torch.zeros(n, 4, 256, device="cuda")
    slots = torch.randperm(n + 64, device="cuda")[:n]
    counter = torch.zeros((), dtype=torch.int32, device="cuda")
    sides = []
    for side in ("k", "v"):
        fmt = prof.side_format(side, 256)
        planes = [torch.zeros(n + 64, 4, b, dtype=torch.uint8, device="cuda") for b in fmt.plane_bytes(256)]
        sides.append((fmt, gs_for(prof, side), planes))

    def write():
        for fmt, gs, planes in sides:
            kv_quant.quantize_into(fmt, x, slots, planes, gs, counter)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        write()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write()
    data = tie_data(prof.side_format("k", 256), gs_for(prof, "k"), n=n, seed=4, nudge=True)
    data[0, 0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    x.copy_(data)
    counter.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for fmt, gs, planes in sides:
        want = ref.quantize(fmt, data, gs)
        assert all(torch.equal(p[slots].cpu(), w) for p, w in zip(planes, want)), fmt.kind
    assert int(counter) == 2 * int(ref.count_nonfinite(data))


@pytest.mark.parametrize("name", [n for n in PROFILES if n != "bf16"])
def test_reference_gives_the_same_bytes_on_cuda_as_on_the_cpu(name):
    """The torch reference (the fallback where the kernels do not apply) is device-independent:
    exact ties, near ties and Gaussian data give the same planes on CUDA as on the CPU."""
    prof = PROFILES[name]
    for side in ("k", "v"):
        fmt, gs = prof.side_format(side, 256), gs_for(prof, side)
        for seed, x in enumerate((tie_data(fmt, gs, n=1024, seed=100), tie_data(fmt, gs, n=1024, seed=101, nudge=True),
                                  gaussian(n=1024, seed=9).float())):
            cpu = ref.quantize(fmt, x, gs)
            cuda = [p.cpu() for p in ref.quantize(fmt, x.cuda(), gs)]
            assert all(torch.equal(a, b) for a, b in zip(cpu, cuda)), (name, side, seed)
