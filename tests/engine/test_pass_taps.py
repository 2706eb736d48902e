"""Exact taps taken inside a prefill pass (the zero-split tap, spec §7.3) against the same taps
taken by splitting the pass: the same snapshots (positions, kinds, state images within fp32
rounding), fewer passes, and a request resumed from one answers as a cold one."""

from __future__ import annotations

import random

from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.engine.api import GenerationRequest, SamplingParams, TapHint
from hpc_cli.engine.engine import Engine
from hpc_cli.model.gdn_taps import TAP_SLOTS



def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

PROMPT = [random.Random(1).randrange(1, 250) for _ in range(300)]
HINTS = [TapHint(37, 3), TapHint(150, 1), TapHint(291, 2)]  # structural, explicit, opener


def _run(model, in_pass: int):
    e = Engine(model, kv_pages=64, prefill_chunk=256, max_concurrency=1, host_cache_mib=16)
    e.cache.tap_scratch = e.cache.tap_scratch[:in_pass]  # a pass takes one tap per tap slot
    e.start()
    try:
        out, fin = e.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=6, temperature=0),
                                                tap_hints=HINTS), timeout=120)
        snaps = {s.frontier: (s.kind, e.cache.snap_phys[s.device_slot]) for s in e.cache.index.snapshots.values()
                 if s.device_slot >= 0}
        images = {p: [t[slot].clone() for t in e.states.parts()] for p, (_, slot) in snaps.items()}
        kinds = {p: k for p, (k, _) in snaps.items()}
        # an image a pass took is published by handing its tap slot to the snapshot (no copy)
        assert e.cache.counters["taps_in_pass"] == (0 if not in_pass else 3 if in_pass > 1 else 2), e.cache.counters
        again, fin2 = e.generate(GenerationRequest(PROMPT[:200] + [7, 8, 9], SamplingParams(max_tokens=6, temperature=0)),
                                 timeout=120)
    finally:
        e.stop()
    e.check_invariants()
    return out, fin, kinds, images, again, fin2


def test_in_pass_taps_equal_split_taps(model):
    out_s, fin_s, kinds_s, images_s, again_s, fin2_s = _run(model, in_pass=0)
    out_p, fin_p, kinds_p, images_p, again_p, fin2_p = _run(model, in_pass=TAP_SLOTS)
    # taps at 37, 150 and 291 were taken in both (the opener covers the tail; each later tap
    # supersedes the lineage's last, spec §9.3); the device keeps the same snapshots either way
    assert kinds_p == kinds_s and {150, 291} <= set(kinds_p), (kinds_p, kinds_s)
    assert kinds_p[150] is SnapshotKind.BOUNDARY and kinds_p[291] is SnapshotKind.TAP
    assert fin_p.usage.timing.taps == fin_s.usage.timing.taps == 3
    for p in kinds_p:
        for a, b in zip(images_p[p], images_s[p]):
            assert rel_err(a.float(), b.float()) < 1e-5, f"snapshot at {p}"
    # split: [0,37) [37,150) [150,291) [291,300); in the pass: [0,256) [256,300) (chunks of 256)
    assert [p.tokens for p in fin_s.usage.timing.passes] == [37, 113, 141, 9]
    assert [p.tokens for p in fin_p.usage.timing.passes] == [256, 44]
    assert out_p == out_s
    # the second prompt shares 200 tokens: it resumes from the explicit tap at 150
    assert fin2_p.usage.reuse_tokens == fin2_s.usage.reuse_tokens == 150
    assert again_p == again_s


def test_a_pass_takes_up_to_its_capacity_then_splits(model):
    """With room for one tap per pass (a graph's slots), the second exact tap inside a pass ends
    it: [0,150) takes 37 itself, [150,300) takes 291; the answers and snapshots are the same."""
    out_s, fin_s, kinds_s, images_s, _, _ = _run(model, in_pass=0)
    out_c, fin_c, kinds_c, images_c, _, _ = _run(model, in_pass=1)
    assert [p.tokens for p in fin_c.usage.timing.passes] == [150, 150]
    assert kinds_c == kinds_s and fin_c.usage.timing.taps == 3
    for p in kinds_c:
        for a, b in zip(images_c[p], images_s[p]):
            assert rel_err(a.float(), b.float()) < 1e-5, f"snapshot at {p}"
    assert out_c == out_s
