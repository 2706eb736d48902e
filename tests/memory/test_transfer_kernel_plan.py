"""The fast planner: a blocks-only kernel job's row table built from the per-engine block template
equals the general plan (plan_kernel of plan_restore / plan_write) launch for launch, row for row
(compared as sorted rows within each launch's wide and narrow parts), on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc_cli import plugins
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.fake import FakeTransferEngine
from hpc_cli.memory.transfer.plan import layer_order_for_shape
from hpc_cli.memory.transfer.records import RestoreBatch
from hpc_cli.shapes import HybridShape, preset
from hpc_kernels import seg_copy

PROFILES = list(plugins.registries().kv_profiles.names())
SMALL = HybridShape(name="t", num_layers=8, full_attention_interval=4, num_kv_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_size=32)
BIG = preset("qwen3.5-27b")


def _engine(shape, profile, *, pages, slabs, chunk_slabs, backend=False, mtp=False, cls=TransferEngine):
    main = PagedKVStorage(plugins.kv_profile(profile), shape.num_attention_layers + (1 if mtp else 0),
                          shape.num_kv_heads, shape.head_dim, pages)
    back = PagedKVStorage(plugins.kv_profile("bf16"), 1, 2, 32, pages, name="dflash") if backend else None
    sb = BundleLayout.for_storage(main, back).slab_bytes
    host = HostSlabStorage(sb, slabs, pin=False, chunk_bytes=chunk_slabs * sb)
    # a state pool, so the layer order keeps the GDN layers between attention layers (stage gaps)
    state = StateSlots(shape.num_gdn_layers, shape.conv_dim, shape.linear_conv_kernel_dim - 1,
                       shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim,
                       shape.hidden_size, 1, dtype=torch.bfloat16)
    return cls(main, host, state=state, backend=back, layer_order=layer_order_for_shape(shape))


def _sorted(rows):
    return rows[np.lexsort(rows.T[::-1])] if len(rows) else rows


def _assert_same(fast, ref):
    assert fast is not None
    assert [(ln.row0, ln.row1, ln.n_wide, ln.stages) for ln in fast.launches] == \
        [(ln.row0, ln.row1, ln.n_wide, ln.stages) for ln in ref.launches]
    assert fast.table.shape == ref.table.shape and fast.table.dtype == ref.table.dtype
    for ln in ref.launches:
        for a, b in ((ln.row0, ln.row0 + ln.n_wide), (ln.row0 + ln.n_wide, ln.row1)):
            assert np.array_equal(_sorted(fast.table[a:b]), _sorted(ref.table[a:b]))


def _cases(pages, slabs):
    n = min(pages, slabs)
    return {
        "one": [(3, 5)],
        "eight_consecutive": [(p, 10 + p) for p in range(8)],
        "scattered": [(7, 2), (1, 19), (4, 11), (12, 3), (9, 0), (2, 25)],
        "reversed_slabs": [(p, 15 - p) for p in range(16)],
        "backend_pages": [(0, 4, 6), (1, 5), (2, 6, 0), (8, 30, 9)],
        "many": [(p, n - 1 - p if p % 3 else p) for p in range(min(300, n))],
    }


GEOMETRIES = {"small": (SMALL, 310, 310, 64), "27b": (BIG, 300, 300, 100)}


@pytest.mark.parametrize("backend", [False, True])
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_template_plan_equals_the_general_plan(geometry, profile, backend):
    shape, pages, slabs, chunk_slabs = GEOMETRIES[geometry]
    eng = _engine(shape, profile, pages=pages, slabs=slabs, chunk_slabs=chunk_slabs, backend=backend,
                  mtp=backend)
    for name, blocks in _cases(pages, slabs).items():
        for limit in (None, 0, 3 * eng.layout.slab_bytes):
            ref = eng.plan_kernel(eng.plan_restore(RestoreBatch(blocks=blocks)), limit)
            _assert_same(eng.plan_kernel_blocks("restore", blocks, limit), ref)
        ref = eng.plan_kernel(eng.plan_write(blocks=blocks))
        _assert_same(eng.plan_kernel_blocks("write", blocks), ref)
        if name == "many" and geometry == "27b":
            plan = eng.plan_kernel_blocks("restore", blocks)
            assert len(plan.launches) == len(eng.main.planes), "300 blocks: a launch per layer (8 MiB limit)"
    # write-through tails are blocks too
    ref = eng.plan_kernel(eng.plan_write(blocks=[(0, 1)], tails=[(5, 9)]))
    _assert_same(eng.plan_kernel_blocks("write", [(0, 1), (5, 9)]), ref)


def test_template_plan_with_unaligned_planes_has_the_same_narrow_rows():
    """A plane whose base is not 16-byte aligned moves as narrow rows in both plans."""
    eng = _engine(SMALL, "int8-g64", pages=40, slabs=40, chunk_slabs=7, backend=True)
    keep = []
    for layer in (0, 1):
        p = eng._main_bases[layer][layer]
        buf = torch.empty(p.numel() + 16, dtype=torch.uint8)
        keep.append(buf)
        eng._main_bases[layer][layer] = buf[3 + layer:3 + layer + p.numel()]
    blocks = [(p, (7 * p) % 40) for p in range(40)]
    for limit in (None, 0, 5 * eng.layout.slab_bytes):
        ref = eng.plan_kernel(eng.plan_restore(RestoreBatch(blocks=blocks)), limit)
        assert any(ln.row1 - ln.row0 > ln.n_wide for ln in ref.launches), "narrow rows expected"
        _assert_same(eng.plan_kernel_blocks("restore", blocks, limit), ref)
    _assert_same(eng.plan_kernel_blocks("write", blocks), eng.plan_kernel(eng.plan_write(blocks=blocks)))


def test_template_plan_replays_to_the_same_bytes():
    eng = _engine(SMALL, "int8-g64", pages=40, slabs=40, chunk_slabs=7, backend=True, mtp=True)
    for pool in (eng.main, eng.backend):
        for layer in pool.planes:
            for p in layer:
                p.copy_(torch_rand(p.shape))
    ref = [[p.clone() for p in layer] for pool in (eng.main, eng.backend) for layer in pool.planes]
    blocks = [(p, 39 - p, (p + 3) % 40) for p in range(12)]
    plan = eng.plan_kernel_blocks("write", blocks)
    for ln in plan.launches:
        seg_copy.copy_rows_ref(plan.table[ln.row0:ln.row1], ln.n_wide)
    for pool in (eng.main, eng.backend):
        for layer in pool.planes:
            for p in layer:
                p.zero_()
    plan = eng.plan_kernel_blocks("restore", blocks, launch_bytes=0)
    for ln in plan.launches:
        seg_copy.copy_rows_ref(plan.table[ln.row0:ln.row1], ln.n_wide)
    got = [layer for pool in (eng.main, eng.backend) for layer in pool.planes]
    nmain = eng.main.num_layers
    for i, (gl, rl) in enumerate(zip(got, ref)):
        for g, r in zip(gl, rl):
            for pm, _, pb in blocks:
                page = pm if i < nmain else pb
                assert bool((g[page] == r[page]).all())


def torch_rand(shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


def test_template_refuses_what_it_does_not_plan():
    eng = _engine(SMALL, "bf16", pages=12, slabs=12, chunk_slabs=5)
    assert eng.plan_kernel_blocks("restore", []) is None
    assert eng.plan_kernel_blocks("restore", [(12, 0)]) is None, "page out of range: the general path asserts"
    assert eng.plan_kernel_blocks("restore", [(0, 12)]) is None
    # CPU: jobs keep the general plan (plain copies), whatever the fast planner could do
    assert eng._restore_job(RestoreBatch(blocks=[(0, 0)])).plan is None
    # with the kernel usable, a blocks-only job is planned from the template, with no CopyOps
    eng.kernel_ok = True
    job = eng._restore_job(RestoreBatch(blocks=[(0, 0), (1, 1)]))
    assert job.plan is not None and job.items == [] and job.method == "kernel"
    assert job.nbytes == 2 * eng.layout.main_bytes
    job = eng._write_job([(0, 0)], (), [(1, 1)])
    assert job.plan is not None and job.nbytes == 2 * eng.layout.main_bytes
    # auto with big bytes per call, or anything else, keeps the general plan
    eng.cudart = object()
    eng.kernel_max_call_bytes = 1
    assert eng._restore_job(RestoreBatch(blocks=[(0, 0)])).plan is None
    eng.copy_method = "kernel"
    assert eng._restore_job(RestoreBatch(blocks=[(0, 0)])).plan is not None
    assert eng._restore_job(RestoreBatch(blocks=[(0, 0)], tail=(1, 1))).plan is None
    # the fake engine records CopyOps: always the general plan
    fake = _engine(SMALL, "bf16", pages=12, slabs=12, chunk_slabs=5, cls=FakeTransferEngine)
    fake.kernel_ok = True
    assert fake._restore_job(RestoreBatch(blocks=[(0, 0)])).plan is None
