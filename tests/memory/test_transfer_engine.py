"""Transfer engine on CPU: bit-exact round trips of KV pages and state images, completion at once."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.memory.transfer.records import RestoreBatch

from transfer_rig import PROFILES, fill_random, rig, snapshot, zero


@pytest.mark.parametrize("profile", PROFILES)
def test_kv_round_trip_is_bit_exact_for_every_profile(profile):
    eng = rig(profile, mtp=True, backend=True)
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
    kv_ref, _ = snapshot(eng)
    ref_gather = [main.gather(layer, [0, 1, 2, 3, 4, 5], n, torch.float32) for layer in range(main.num_layers)]
    # pages 0..4 to scattered slabs (runs of 2 and 3 across a chunk boundary), page 5 as a tail
    blocks = [(0, 5), (1, 6), (2, 7), (3, 8), (4, 20, 4)]
    eng.write_through(blocks=blocks[:4] + [(4, 20)], tails=[(5, 30)])
    assert [c.ok for c in eng.poll()] == [True]
    zero(eng)
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
    eng = rig()
    fill_random(eng, 3)
    _, st_ref = snapshot(eng)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    slabs = slabs[:need]
    assert len(slabs) == need, "test geometry: image needs more slabs than listed"
    eng.write_through(images=[(2, slabs)])
    eng.poll()
    # the packed image is the parts back to back
    packed = torch.cat([eng.host.slab_view(s) for s in slabs])[:eng.state.image_bytes]
    expect = torch.cat([eng.state.slot_bytes(t, 2) for _, _, t in eng.state.image_parts()])
    assert torch.equal(packed, expect)
    zero(eng)
    eng.restore(RestoreBatch(image=(0, slabs)))
    assert eng.poll()[0].ok
    for t, r in zip(eng.state.parts(), st_ref):
        assert torch.equal(t[0], r[2])
        assert not t[1].any() and not t[2].any()


def test_cpu_engine_completes_at_once_and_poll_reports_once():
    eng = rig()
    j = eng.write_through(blocks=[(0, 0)])
    assert [c.job_id for c in eng.poll()] == [j.job_id]
    assert eng.poll() == [] and j.done
    t = eng.restore(RestoreBatch())
    t.wait_layer(0), t.wait_prelude(), t.wait_all()
    assert eng.poll()[0].job_id == t.job_id
