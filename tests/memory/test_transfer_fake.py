"""The fake transfer engine: copies only when told, completes in stream order, fails jobs."""

from __future__ import annotations

import torch

from hpc_cli.memory.transfer.records import RestoreBatch

from transfer_rig import fill_random, rig, snapshot, zero


def test_fake_engine_copies_only_when_told_and_fails_jobs():
    eng = rig(fake=True)
    fill_random(eng, 7)
    kv_ref, _ = snapshot(eng)
    w1 = eng.write_through(blocks=[(0, 1), (1, 2)])
    w2 = eng.write_through(blocks=[(2, 3)])
    assert not eng.host.slab_view(1).any(), "nothing lands before completion"
    assert eng.poll() == [] and not w1.done
    eng.complete(w2.job_id)  # completes in stream order: w1 then w2
    done = eng.poll()
    assert [c.job_id for c in done] == [w1.job_id, w2.job_id] and all(c.ok for c in done)
    assert w1.done and w2.done and eng.host.slab_view(1).any()
    zero(eng)
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
