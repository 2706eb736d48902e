"""Transfer engine on CUDA: pinned chunks, 2-D copies, the segment copy kernel, per-layer events
(run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.plan import layer_order_for_shape
from hpc_cli.memory.transfer.records import RestoreBatch
from hpc_cli.shapes import HybridShape
from hpc_kernels import seg_copy

pytestmark = pytest.mark.gpu

SHAPE = HybridShape(name="g", num_layers=8, full_attention_interval=4, num_kv_heads=4, head_dim=256,
                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                    linear_value_head_dim=64, linear_conv_kernel_dim=4, hidden_size=512)


PROFILES = ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]


def _rig(use_cuda_python=True, profile="int8-g64", backend=False, **engine_args):
    dev = torch.device("cuda")
    main = PagedKVStorage(plugins.kv_profile(profile), SHAPE.num_attention_layers, SHAPE.num_kv_heads,
                          SHAPE.head_dim, 64, device=dev)
    back = PagedKVStorage(plugins.kv_profile("bf16"), 1, 2, 32, 64, device=dev, name="dflash") if backend else None
    state = StateSlots(SHAPE.num_gdn_layers, SHAPE.conv_dim, 3, SHAPE.linear_num_value_heads,
                       SHAPE.linear_key_head_dim, SHAPE.linear_value_head_dim, SHAPE.hidden_size, 3,
                       dtype=torch.bfloat16, device=dev, extra_parts={"ring": ((2, 64, 8), torch.bfloat16)})
    sb = BundleLayout.for_storage(main, back).slab_bytes
    host = HostSlabStorage(sb, 100, pin=True, chunk_bytes=16 * sb)
    eng = TransferEngine(main, host, state=state, backend=back, layer_order=layer_order_for_shape(SHAPE),
                         use_cuda_python=use_cuda_python, **engine_args)
    for pool in (main, back):
        for layer in pool.planes if pool is not None else ():
            for p in layer:
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device=dev))
    for t in state.parts():
        t.copy_(torch.randn(t.shape, device=dev).to(t.dtype))
    return eng


def _need_kernel(method):
    if method == "kernel" and not seg_copy.available():
        pytest.skip("Triton does not import")


@pytest.mark.parametrize("method", ["dma", "kernel"])
@pytest.mark.parametrize("use_cuda_python", [True, False])
def test_gpu_round_trip_runs_across_chunks(use_cuda_python, method):
    _need_kernel(method)
    eng = _rig(use_cuda_python, copy_method=method)
    if use_cuda_python and not eng.uses_2d_copies:
        pytest.skip("cuda-python is not installed")
    assert eng.host.pinned and eng.max_pitch >= 1 << 30
    main, state = eng.main, eng.state
    ref = [[p.clone() for p in layer] for layer in main.planes]
    sref = [t.clone() for t in state.parts()]
    blocks = [(p, 10 + p) for p in range(20)] + [(30, 60), (31, 62), (32, 64)]  # crosses chunk 16|32|48
    need = -(-state.image_bytes // eng.host.slab_bytes)
    img = list(range(99, 99 - need, -1))
    w = eng.write_through(blocks=blocks, images=[(1, img)])
    assert w.method == method
    assert all(c.ok for c in eng.drain())
    for layer in main.planes:
        for p in layer:
            p.zero_()
    for t in state.parts():
        t.zero_()
    moved = [(p + 40, s) for p, s in blocks[:20]] + [(61, 60), (62, 62), (63, 64)]
    t = eng.restore(RestoreBatch(blocks=moved, image=(0, img)))
    for i in range(SHAPE.num_layers):
        t.wait_layer(i)
    t.wait_all()
    torch.cuda.current_stream().synchronize()
    for layer, rlayer in zip(main.planes, ref):
        for plane, rp in zip(layer, rlayer):
            for (p, _), (q, _) in zip(blocks, moved):
                assert torch.equal(plane[q], rp[p])
    for a, r in zip(state.parts(), sref):
        assert torch.equal(a[0], r[1])
    assert [c.ok for c in eng.drain()] == [True]


@pytest.mark.parametrize("method,launch_bytes", [("dma", None), ("kernel", 0), ("kernel", 1 << 40)])
def test_gpu_layer_event_follows_its_copies(method, launch_bytes):
    """A kernel that waits on layer i's event sees that layer's bytes (checked on every layer);
    the kernel path with one launch per stage and with one launch for the whole restore."""
    _need_kernel(method)
    args = {} if launch_bytes is None else {"kernel_launch_bytes": launch_bytes}
    eng = _rig(copy_method=method, **args)
    main = eng.main
    blocks = [(p, p) for p in range(48)]
    eng.write_through(blocks=blocks)
    eng.drain()
    ref = [[p[:48].clone() for p in layer] for layer in main.planes]
    for layer in main.planes:
        for p in layer:
            p.zero_()
    torch.cuda._sleep(20_000_000)  # keep the restore stream behind the compute stream for a while
    t = eng.restore(RestoreBatch(blocks=blocks))
    assert t.method == method
    order = layer_order_for_shape(SHAPE)
    sums = []
    for i, (kind, idx) in enumerate(order):
        if kind == "attn":
            t.wait_layer(i)
            sums.append([p[:48].sum(dtype=torch.int64) for p in main.planes[idx]])
    torch.cuda.synchronize()
    want = [[p.sum(dtype=torch.int64) for p in layer] for layer in ref]
    assert [[int(x) for x in s] for s in sums] == [[int(x) for x in w] for w in want]
    assert eng.poll()[-1].ok


@pytest.mark.parametrize("method", [None, "torch", "per_layer", "memcpy2d", "kernel"])
def test_gpu_tap_copies_one_image(method):
    _need_kernel(method)
    eng = _rig()
    st = eng.state
    if method == "memcpy2d" and eng.cudart is None:
        pytest.skip("cuda-python is not installed")
    before = [t.clone() for t in st.parts()]
    st.copy_slot(0, 2, method)
    st.copy_slot(2, 1, method)  # the kernel's table is reused with other slots
    for t, b in zip(st.parts(), before):
        assert torch.equal(t[2], b[0]) and torch.equal(t[1], b[0]) and torch.equal(t[0], b[0])
    st.copy_slot(1, 1, method)


@pytest.mark.parametrize("profile", PROFILES)
def test_gpu_kernel_round_trip_every_profile(profile):
    """Bit-exact device -> host -> device through the kernel path: runs, lone blocks, a chunk
    crossing, a tail, a backend pool and an image in scattered slabs."""
    _need_kernel("kernel")
    eng = _rig(profile=profile, backend=True, copy_method="kernel", kernel_launch_bytes=1 << 16)
    main, back, state = eng.main, eng.backend, eng.state
    ref = [[p.clone() for p in layer] for pool in (main, back) for layer in pool.planes]
    sref = [t.clone() for t in state.parts()]
    blocks = [(p, 10 + p) for p in range(8)] + [(20, 30, 5), (21, 33), (22, 47), (23, 48)]
    need = -(-state.image_bytes // eng.host.slab_bytes)
    img = [90, 3, 71, 55, 99, 60, 2, 81, 4, 95, 77, 66][:need]
    assert len(img) == need, "test geometry: image needs more slabs than listed"
    w = eng.write_through(blocks=blocks, images=[(2, img)], tails=[(30, 50)])
    assert w.method == "kernel" and all(c.ok for c in eng.drain())
    packed = torch.cat([eng.host.slab_view(s) for s in img])[:state.image_bytes]
    expect = torch.cat([state.slot_bytes(t, 2) for _, _, t in state.image_parts()])
    assert torch.equal(packed.cuda(), expect)
    for pool in (main, back):
        for layer in pool.planes:
            for p in layer:
                p.zero_()
    for t in state.parts():
        t.zero_()
    moved = [(30 + p, s, *rest) for p, s, *rest in blocks]  # pages 30..37, 50..53
    t = eng.restore(RestoreBatch(blocks=moved, tail=(63, 50), image=(0, img)))
    assert t.method == "kernel"
    t.wait_all()
    torch.cuda.current_stream().synchronize()
    nmain = main.num_layers
    for li, (layer, rlayer) in enumerate(zip([*main.planes, *back.planes], ref)):
        for plane, rp in zip(layer, rlayer):
            for (p, _, *rest), (q, _, *_) in zip(blocks, moved):
                src = p if li < nmain or not rest else rest[0]
                dst = q if li < nmain or not rest else rest[0]
                assert torch.equal(plane[dst], rp[src]), (profile, li, p, q)
            assert torch.equal(plane[63], rp[30])
    for a, r in zip(state.parts(), sref):
        assert torch.equal(a[0], r[2])
    assert [c.ok for c in eng.drain()] == [True]


def test_gpu_auto_uses_the_kernel_for_small_jobs_only():
    _need_kernel("kernel")
    eng = _rig(copy_method="auto")
    assert eng.kernel_ok, eng.kernel_unavailable
    assert all(d is not None for d in eng.host.device_ptrs) and len(eng.host.device_ptrs) == len(eng.host.chunks)
    small = eng.write_through(blocks=[(0, 0)])
    # the rig's small shape and 16-slab chunks keep every DMA call of 48 blocks under the default
    # 1 MiB, so the same job is taken to DMA by a smaller threshold than its average call
    big_job = [(p, p) for p in range(48)]
    big_eng = _rig(copy_method="auto", kernel_max_call_bytes=4096)
    big = big_eng.write_through(blocks=big_job)
    assert small.method == "kernel" and big.method == "dma" and eng.write_through(blocks=big_job).method == "kernel"
    assert all(c.ok for c in eng.drain()) and all(c.ok for c in big_eng.drain())
    assert _rig(copy_method="dma").write_through(blocks=[(0, 0)]).method == "dma"


@pytest.mark.parametrize("programs", [None, 3])  # a program a row; three programs looping over the rows
def test_gpu_segment_kernel_unaligned_device_and_pinned_host(programs):
    _need_kernel("kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.zeros_like(a)
    h = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    segs = [(0, 0, 4096), (8192, 16384, 5000), (20003, 30001, 3000), (40000, 40000, 1),
            (50000, 50000, 0), (65536, 65536, 7 * 16384 + 48)]
    A, B, H = a.data_ptr(), b.data_ptr(), h.data_ptr()
    keep = [seg_copy.copy_segments([A + s for s, _, _ in segs], [B + d for _, d, _ in segs],
                                   [n for _, _, n in segs], "cuda", programs=programs),
            seg_copy.copy_segments([A + s for s, _, _ in segs], [H + d for _, d, _ in segs],
                                   [n for _, _, n in segs], "cuda", programs=programs)]
    torch.cuda.synchronize()
    mask = torch.zeros(1 << 20, dtype=torch.bool)
    for s, d, n in segs:
        assert torch.equal(b[d:d + n], a[s:s + n]) and torch.equal(h[d:d + n], a[s:s + n].cpu())
        mask[d:d + n] = True
    assert not b[mask.cuda().logical_not()].any() and not h[~mask].any()
    c = torch.zeros_like(a)
    keep.append(seg_copy.copy_segments([H + d for _, d, _ in segs], [c.data_ptr() + d for _, d, _ in segs],
                                       [n for _, _, n in segs], "cuda", programs=programs))
    torch.cuda.synchronize()
    assert torch.equal(c, b)
    del keep


def test_gpu_kernel_stages_share_one_event_per_launch():
    """A blocks-only kernel restore is planned from the block template; a launch's stages share
    one event, and retiring the job returns each event to the pool once."""
    _need_kernel("kernel")
    eng = _rig(copy_method="kernel")
    blocks = [(p, p) for p in range(4)]
    eng.write_through(blocks=blocks)
    eng.drain()
    for _ in range(3):
        t = eng.restore(RestoreBatch(blocks=blocks))
        job = t._job
        assert job.plan is not None and job.items == [] and t.method == "kernel"
        assert len(job.plan.launches) == 1 and len({id(ev) for ev in job.events.values()}) == 1
        assert sorted(job.events) == list(job.plan.launches[0].stages)
        assert [c.ok for c in eng.drain()] == [True]
        pool = eng._event_pool
        assert len({id(ev) for ev in pool}) == len(pool), "an event went back to the pool twice"
    eng2 = _rig(copy_method="kernel", kernel_launch_bytes=0)
    t = eng2.restore(RestoreBatch(blocks=blocks))
    launches = t._job.plan.launches
    assert len({id(ev) for ev in t._job.events.values()}) == len(launches) > 1
    assert [c.ok for c in eng2.drain()] == [True]
