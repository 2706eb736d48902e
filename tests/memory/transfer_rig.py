"""The transfer engine's CPU test rig: a small hybrid shape's pools, state slots and host slabs
(unpinned, several chunks), and helpers that fill, snapshot and zero the device side."""

from __future__ import annotations

import torch

from hpc_cli import plugins
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.fake import FakeTransferEngine
from hpc_cli.memory.transfer.plan import layer_order_for_shape
from hpc_cli.shapes import HybridShape


PROFILES = ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]
SHAPE = HybridShape(name="t", num_layers=8, full_attention_interval=4, num_kv_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_size=32)


def rig(profile="bf16", *, pages=12, slabs=40, chunk_slabs=7, mtp=False, backend=False, fake=False, ring=True):
    prof = plugins.kv_profile(profile)
    main = PagedKVStorage(prof, SHAPE.num_attention_layers + (1 if mtp else 0), SHAPE.num_kv_heads,
                          SHAPE.head_dim, pages)
    back = PagedKVStorage(plugins.kv_profile("bf16"), 1, 2, 32, pages, name="dflash") if backend else None
    extra = {"ring": ((2, 3, 8), torch.bfloat16)} if ring else None
    state = StateSlots(SHAPE.num_gdn_layers, SHAPE.conv_dim, SHAPE.linear_conv_kernel_dim - 1,
                       SHAPE.linear_num_value_heads, SHAPE.linear_key_head_dim, SHAPE.linear_value_head_dim,
                       SHAPE.hidden_size, 4, dtype=torch.bfloat16, extra_parts=extra)
    sb = BundleLayout.for_storage(main, back).slab_bytes
    host = HostSlabStorage(sb, slabs, pin=False, chunk_bytes=chunk_slabs * sb)
    for c in host.chunks:  # host memory starts uninitialised
        c.zero_()
    cls = FakeTransferEngine if fake else TransferEngine
    eng = cls(main, host, state=state, backend=back, layer_order=layer_order_for_shape(SHAPE))
    return eng


def fill_random(eng, seed=0):
    g = torch.Generator().manual_seed(seed)
    for pool in (eng.main, eng.backend):
        if pool is None:
            continue
        for layer in pool.planes:
            for p in layer:
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))
    for t in eng.state.parts():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def snapshot(eng):
    kv = [[p.clone() for p in layer] for pool in (eng.main, eng.backend) if pool is not None for layer in pool.planes]
    return kv, [t.clone() for t in eng.state.parts()]


def zero(eng):
    for pool in (eng.main, eng.backend):
        if pool is not None:
            for layer in pool.planes:
                for p in layer:
                    p.zero_()
    for t in eng.state.parts():
        t.zero_()
