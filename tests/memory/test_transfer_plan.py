"""Transfer planning on CPU: restores in forward-order stages with an event after each, runs as
one copy per plane."""

from __future__ import annotations

from hpc_cli.memory.transfer.plan import layer_order_for_shape
from hpc_cli.memory.transfer.records import CopyOp, Mark, RestoreBatch

from transfer_rig import SHAPE, rig


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
    eng = rig(mtp=True, backend=True, fake=True)
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
    eng = rig(fake=True)
    t = eng.restore(RestoreBatch(blocks=[(0, 1)]))
    job = t._job
    attn_stages = [i + 1 for i, (k, _) in enumerate(eng.layer_order) if k == "attn"]
    assert sorted(job.events) == attn_stages  # no prelude, no GDN stages
    # layer 0 (GDN) has nothing before it to wait for; layer 5 waits for the first attention layer
    assert job.event_at_or_before(1) is None
    assert job.event_at_or_before(6) is job.events[attn_stages[0]]


def test_runs_become_one_copy_per_plane():
    eng = rig(pages=40, slabs=40, chunk_slabs=40)
    items = eng.plan_write(blocks=[(p, 3 + p) for p in range(20)])
    copies = [it for it in items if isinstance(it, CopyOp)]
    assert len(copies) == eng.main.num_layers * len(eng.main.layout.planes)
    assert all(c.rows == 20 and c.dst_pitch == eng.host.slab_bytes for c in copies)
    assert all(c.views()[0].shape == (20, c.width) for c in copies)
