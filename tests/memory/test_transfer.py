"""Transfer engine on CPU: bit-exact round trips, forward-order stages, the fake engine."""

from __future__ import annotations

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.memory.host_slabs import BundleLayout, HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer import (CopyOp, FakeTransferEngine, Mark, RestoreBatch, TransferEngine,
                                     layer_order_for_shape)
from hpc_cli.shapes import HybridShape

PROFILES = ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]
SHAPE = HybridShape(name="t", num_layers=8, full_attention_interval=4, num_kv_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_size=32)


def _rig(profile="bf16", *, pages=12, slabs=40, chunk_slabs=7, mtp=False, backend=False, fake=False, ring=True):
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


def _fill_random(eng, seed=0):
    g = torch.Generator().manual_seed(seed)
    for pool in (eng.main, eng.backend):
        if pool is None:
            continue
        for layer in pool.planes:
            for p in layer:
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))
    for t in eng.state.parts():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _snapshot(eng):
    kv = [[p.clone() for p in layer] for pool in (eng.main, eng.backend) if pool is not None for layer in pool.planes]
    return kv, [t.clone() for t in eng.state.parts()]


def _zero(eng):
    for pool in (eng.main, eng.backend):
        if pool is not None:
            for layer in pool.planes:
                for p in layer:
                    p.zero_()
    for t in eng.state.parts():
        t.zero_()


@pytest.mark.parametrize("profile", PROFILES)
def test_kv_round_trip_is_bit_exact_for_every_profile(profile):
    eng = _rig(profile, mtp=True, backend=True)
    main = eng.main
    g = torch.Generator().manual_seed(1)
    n = 5 * 64 + 17
    slots = torch.arange(n)
    try:
        for layer in range(main.num_layers):
            k = torch.randn(n, main.kv_heads, main.head_dim, generator=g)
            v = torch.randn(n, main.kv_heads, main.head_dim, generator=g)
            main.write(layer, slots, k, v)
    except NotImplementedError:
        pytest.skip(f"{profile} quantize is not implemented yet")
    for layer in eng.backend.planes:
        for p in layer:
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))
    kv_ref, _ = _snapshot(eng)
    ref_gather = [main.gather(layer, [0, 1, 2, 3, 4, 5], n, torch.float32) for layer in range(main.num_layers)]
    # pages 0..4 to scattered slabs (runs of 2 and 3 across a chunk boundary), page 5 as a tail
    blocks = [(0, 5), (1, 6), (2, 7), (3, 8), (4, 20, 4)]
    eng.write_through(blocks=blocks[:4] + [(4, 20)], tails=[(5, 30)])
    assert [c.ok for c in eng.poll()] == [True]
    _zero(eng)
    eng.restore(RestoreBatch(blocks=[(9, 5), (10, 6), (11, 7), (1, 8), (4, 20)], tail=(5, 30)))
    [c] = eng.poll()
    assert c.ok and c.kind == "restore"
    mapping = {0: 9, 1: 10, 2: 11, 3: 1, 4: 4, 5: 5}
    for a, ref in zip([layer for pool in (eng.main, eng.backend) for layer in pool.planes], kv_ref):
        for plane, rplane in zip(a, ref):
            for src, dst in mapping.items():
                assert torch.equal(plane[dst], rplane[src])
    for layer in range(main.num_layers):
        k, v = main.gather(layer, [9, 10, 11, 1, 4, 5], n, torch.float32)
        assert torch.equal(k, ref_gather[layer][0]) and torch.equal(v, ref_gather[layer][1])


@pytest.mark.parametrize("slabs", [[3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 2, 17, 9, 11, 25, 1, 14, 0]])
def test_state_image_round_trip(slabs):
    eng = _rig()
    _fill_random(eng, 3)
    _, st_ref = _snapshot(eng)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    slabs = slabs[:need]
    assert len(slabs) == need, "test geometry: image needs more slabs than listed"
    eng.write_through(images=[(2, slabs)])
    eng.poll()
    # the packed image is the parts back to back
    packed = torch.cat([eng.host.slab_view(s) for s in slabs])[:eng.state.image_bytes]
    expect = torch.cat([eng.state.slot_bytes(t, 2) for _, _, t in eng.state.image_parts()])
    assert torch.equal(packed, expect)
    _zero(eng)
    eng.restore(RestoreBatch(image=(0, slabs)))
    assert eng.poll()[0].ok
    for t, r in zip(eng.state.parts(), st_ref):
        assert torch.equal(t[0], r[2])
        assert not t[1].any() and not t[2].any()


def _check_stage_order(items, n_stages):
    """Stages never go back; Mark(s) follows every copy of stage s and precedes later stages."""
    last_stage = -1
    open_stage = None
    for it in items:
        if isinstance(it, CopyOp):
            assert it.stage >= last_stage, f"{it.tag} of stage {it.stage} after stage {last_stage}"
            assert open_stage in (None, it.stage), f"stage {open_stage} never got its event"
            last_stage = open_stage = it.stage
        else:
            assert it.stage == open_stage, f"event {it.stage} without copies"
            open_stage = None
    assert open_stage is None
    assert last_stage < n_stages


def test_restore_is_enqueued_in_forward_order_with_an_event_after_each_stage():
    eng = _rig(mtp=True, backend=True, fake=True)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    batch = RestoreBatch(blocks=[(0, 1), (1, 2), (2, 3, 7)], tail=(6, 10), image=(1, list(range(20, 20 + need))))
    items = eng.plan_restore(batch)
    _check_stage_order(items, 1 + SHAPE.num_layers)
    prelude = [it.tag for it in items if isinstance(it, CopyOp) and it.stage == 0]
    assert any(t.startswith("main L2") for t in prelude), "MTP's extra main layer is in the prelude"
    assert any(t.startswith("backend") for t in prelude) and any("hidden" in t for t in prelude)
    assert any("ring" in t for t in prelude) and not any("recurrent" in t for t in prelude)
    order = layer_order_for_shape(SHAPE)
    for i, (kind, idx) in enumerate(order):
        tags = [it.tag for it in items if isinstance(it, CopyOp) and it.stage == i + 1]
        if kind == "attn":
            assert tags and all(t.startswith(f"main L{idx} ") for t in tags)
            # one copy per plane per run: pages 0,1,2 -> slabs 1,2,3 is one run
            assert len(tags) == len(eng.main.layout.planes)
        else:
            assert {t.split()[1] for t in tags} == {f"conv{idx}", f"recurrent{idx}"}
    assert sum(isinstance(it, Mark) for it in items) == 1 + SHAPE.num_layers
    # the fake's log is the same order, and waits resolve to the right events
    t = eng.restore(batch)
    log = [e for e in eng.log if e[1] == t.job_id]
    assert [e[2] for e in log if e[0] == "event"] == list(range(1 + SHAPE.num_layers))
    t.wait_layer(3)
    assert eng.log[-1] == ("wait", t.job_id, 4)


def test_restore_without_image_records_events_only_for_layers_with_copies():
    eng = _rig(fake=True)
    t = eng.restore(RestoreBatch(blocks=[(0, 1)]))
    job = t._job
    attn_stages = [i + 1 for i, (k, _) in enumerate(eng.layer_order) if k == "attn"]
    assert sorted(job.events) == attn_stages  # no prelude, no GDN stages
    # layer 0 (GDN) has nothing before it to wait for; layer 5 waits for the first attention layer
    assert job.event_at_or_before(1) is None
    assert job.event_at_or_before(6) is job.events[attn_stages[0]]


def test_fake_engine_copies_only_when_told_and_fails_jobs():
    eng = _rig(fake=True)
    _fill_random(eng, 7)
    kv_ref, _ = _snapshot(eng)
    w1 = eng.write_through(blocks=[(0, 1), (1, 2)])
    w2 = eng.write_through(blocks=[(2, 3)])
    assert not eng.host.slab_view(1).any(), "nothing lands before completion"
    assert eng.poll() == [] and not w1.done
    eng.complete(w2.job_id)  # completes in stream order: w1 then w2
    done = eng.poll()
    assert [c.job_id for c in done] == [w1.job_id, w2.job_id] and all(c.ok for c in done)
    assert w1.done and w2.done and eng.host.slab_view(1).any()
    _zero(eng)
    r1 = eng.restore(RestoreBatch(blocks=[(5, 1)]))
    r2 = eng.restore(RestoreBatch(blocks=[(6, 2)]))
    eng.fail(r1.job_id, "bus error")
    out = eng.poll()
    assert [(c.job_id, c.ok, c.error) for c in out] == [(r1.job_id, False, "bus error")]
    assert not eng.main.planes[0][0][5].any(), "a failed job copies nothing"
    assert not r2.done
    assert [c.job_id for c in eng.drain()] == [r2.job_id]
    assert torch.equal(eng.main.planes[0][0][6], kv_ref[0][0][1])
    r2.wait_layer(0)  # retired: no-op (logged by the fake)
    assert eng.pending == 0


def test_cpu_engine_completes_at_once_and_poll_reports_once():
    eng = _rig()
    j = eng.write_through(blocks=[(0, 0)])
    assert [c.job_id for c in eng.poll()] == [j.job_id]
    assert eng.poll() == [] and j.done
    t = eng.restore(RestoreBatch())
    t.wait_layer(0), t.wait_prelude(), t.wait_all()
    assert eng.poll()[0].job_id == t.job_id


def test_runs_become_one_copy_per_plane():
    eng = _rig(pages=40, slabs=40, chunk_slabs=40)
    items = eng.plan_write(blocks=[(p, 3 + p) for p in range(20)])
    copies = [it for it in items if isinstance(it, CopyOp)]
    assert len(copies) == eng.main.num_layers * len(eng.main.layout.planes)
    assert all(c.rows == 20 and c.dst_pitch == eng.host.slab_bytes for c in copies)
    assert all(c.views()[0].shape == (20, c.width) for c in copies)
