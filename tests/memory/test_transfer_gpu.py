"""Transfer engine on CUDA: pinned chunks, 2-D copies, per-layer events (run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.memory.host_slabs import BundleLayout, HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer import RestoreBatch, TransferEngine, layer_order_for_shape
from hpc_cli.shapes import HybridShape

pytestmark = pytest.mark.gpu

SHAPE = HybridShape(name="g", num_layers=8, full_attention_interval=4, num_kv_heads=4, head_dim=256,
                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                    linear_value_head_dim=64, linear_conv_kernel_dim=4, hidden_size=512)


def _rig(use_cuda_python=True, profile="int8-g64"):
    dev = torch.device("cuda")
    main = PagedKVStorage(plugins.kv_profile(profile), SHAPE.num_attention_layers, SHAPE.num_kv_heads,
                          SHAPE.head_dim, 64, device=dev)
    state = StateSlots(SHAPE.num_gdn_layers, SHAPE.conv_dim, 3, SHAPE.linear_num_value_heads,
                       SHAPE.linear_key_head_dim, SHAPE.linear_value_head_dim, SHAPE.hidden_size, 3,
                       dtype=torch.bfloat16, device=dev, extra_parts={"ring": ((2, 64, 8), torch.bfloat16)})
    sb = BundleLayout.for_storage(main).slab_bytes
    host = HostSlabStorage(sb, 100, pin=True, chunk_bytes=16 * sb)
    eng = TransferEngine(main, host, state=state, layer_order=layer_order_for_shape(SHAPE),
                         use_cuda_python=use_cuda_python)
    for layer in main.planes:
        for p in layer:
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device=dev))
    for t in state.parts():
        t.copy_(torch.randn(t.shape, device=dev).to(t.dtype))
    return eng


@pytest.mark.parametrize("use_cuda_python", [True, False])
def test_gpu_round_trip_runs_across_chunks(use_cuda_python):
    eng = _rig(use_cuda_python)
    if use_cuda_python and not eng.uses_2d_copies:
        pytest.skip("cuda-python is not installed")
    assert eng.host.pinned and eng.max_pitch >= 1 << 30
    main, state = eng.main, eng.state
    ref = [[p.clone() for p in layer] for layer in main.planes]
    sref = [t.clone() for t in state.parts()]
    blocks = [(p, 10 + p) for p in range(20)] + [(30, 60), (31, 62), (32, 64)]  # crosses chunk 16|32|48
    need = -(-state.image_bytes // eng.host.slab_bytes)
    img = list(range(99, 99 - need, -1))
    eng.write_through(blocks=blocks, images=[(1, img)])
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


def test_gpu_layer_event_follows_its_copies():
    """A kernel that waits on layer i's event sees that layer's bytes (checked on every layer)."""
    eng = _rig()
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


@pytest.mark.parametrize("method", [None, "torch", "per_layer", "memcpy2d"])
def test_gpu_tap_copies_one_image(method):
    eng = _rig()
    st = eng.state
    if method == "memcpy2d" and eng.cudart is None:
        pytest.skip("cuda-python is not installed")
    before = [t.clone() for t in st.parts()]
    st.copy_slot(0, 2, method)
    for t, b in zip(st.parts(), before):
        assert torch.equal(t[2], b[0]) and torch.equal(t[1], b[1])
