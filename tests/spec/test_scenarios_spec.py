"""The engine's cache scenarios (tests/engine/test_scenarios.py) rerun with each backend."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.engine.api import GenerationRequest

from helpers import BACKENDS, backend, greedy, make, run, settle, tap_engine, tokens


def floor64(x: int) -> int:
    return x - x % BLOCK_TOKENS


def _first_logprobs(engine, prompt, n):
    toks, fin = engine.submit(GenerationRequest(list(prompt), greedy(n, logprobs=20))).result(timeout=300)
    assert fin.reason == "length", fin.error
    return [t.token_id for t in toks], dict(toks[0].top_logprobs), fin


@pytest.mark.parametrize("name", BACKENDS)
def test_resume_equivalence(model, name):
    base = tokens(230, seed=1)
    full = base + tokens(45, seed=2)
    N = 24
    off = make(model, reuse=False, kv_pages=32)
    r_toks, r_lp, _ = _first_logprobs(off, full, N)
    settle(off)
    e = make(model, backend(name, {tuple(full): r_toks}), kv_pages=32, host_cache_mib=16)
    run(e, base, 1)
    s_toks, s_lp, fin = _first_logprobs(e, full, N)
    assert fin.usage.reuse_tokens >= floor64(len(base) - 1), fin.usage
    assert fin.usage.prefill_tokens == len(full) - fin.usage.reuse_tokens
    assert max(abs(r_lp[k] - s_lp[k]) for k in set(r_lp) & set(s_lp)) <= 1e-3
    assert s_toks == r_toks
    settle(e)


@pytest.mark.parametrize("name", BACKENDS)
def test_multi_turn_exact_endpoint_reuse(model, name):
    refs: dict = {}
    e = make(model, backend(name, refs), host_cache_mib=16)
    seen = {}
    orig_finish = e.cache.finish

    def finish(lane, **kw):
        seen.update(pos=lane.pos, tail_page=lane.pages[lane.pos // BLOCK_TOKENS], slot=lane.state_slot)
        orig_finish(lane, **kw)

    e.cache.finish = finish
    prompt = tokens(150, seed=3)
    off = make(model, reuse=False)
    for turn in range(3):
        refs[tuple(prompt)] = run(off, prompt, 60)[0]
        gen, fin = run(e, prompt, 60)
        assert gen == refs[tuple(prompt)], (name, turn)
        if turn:
            assert fin.usage.reuse_tokens == f_end, (turn, fin.usage, f_end)
        f_end = seen["pos"]
        assert f_end == len(prompt) + len(gen) - 1
        ends = [s for s in e.cache.index.snapshots.values() if s.kind is SnapshotKind.ENDPOINT
                and s.frontier == f_end and s.alive]
        assert len(ends) == 1
        if f_end % BLOCK_TOKENS:
            assert ends[0].tail_pages == (seen["tail_page"],)
        assert e.cache.snap_phys[ends[0].device_slot] == seen["slot"]
        prompt = prompt + gen + tokens(30, seed=10 + turn)
    st = settle(e)
    settle(off)
    assert st["counters"]["published"]["endpoint"] >= 3


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_taps_and_blocks_only_committed(model, name):
    """A long prompt with ladder taps: every published snapshot and block sits at or below the
    committed frontier; the MTP layer / DFlash pool / DFlash2 rings are restored with them."""
    e = make(model, name, host_cache_mib=16, tap_ladder_tokens=128, tap_min_gap_tokens=64, max_new_taps=8)
    p = tokens(520, seed=6)
    run(e, p, 3)
    frontiers = sorted(s.frontier for s in e.cache.index.snapshots.values() if s.alive)
    assert len(frontiers) >= 3, frontiers
    edited = list(p)
    edited[400] = (edited[400] % 249) + 1
    out, fin = run(e, edited, 12)
    assert fin.usage.reuse_tokens == max(f for f in frontiers if f <= 400), (fin.usage, frontiers)
    settle(e)
    off = make(model, reuse=False)
    ref, _ = run(off, edited, 12)
    settle(off)
    assert out == ref


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_taps_inside_the_pass_with_a_backend(model, name):
    """MTP's and DFlash's own state lives in pages, so their passes take exact taps themselves (no
    split); DFlash2's rings are a part of the state image, which its drafter fills for the pass's
    taps (ring taps). A request resumed from a tap answers as a cold one."""
    from hpc_cli.engine.api import TapHint

    prompt = tokens(300, seed=21)
    hints = [TapHint(37, 3), TapHint(150, 1), TapHint(291, 2)]  # structural, explicit, opener
    second = prompt[:200] + [7, 8, 9]
    e = make(model, name, host_cache_mib=16, prefill_chunk=256, max_concurrency=1, kv_pages=64)
    out, fin = e.generate(GenerationRequest(prompt, greedy(6), tap_hints=hints), timeout=120)
    in_pass = e.cache.counters["taps_in_pass"]
    again, fin2 = e.generate(GenerationRequest(second, greedy(6)), timeout=120)
    passes = [p.tokens for p in fin.usage.timing.passes]
    settle(e)
    assert in_pass == 3 and passes == [256, 44], (in_pass, passes)
    assert fin.usage.timing.taps == 3
    assert fin2.usage.reuse_tokens == 150, fin2.usage  # resumed from the explicit tap
    off = make(model, reuse=False, prefill_chunk=256, kv_pages=64)
    assert off.generate(GenerationRequest(prompt, greedy(6)), timeout=120)[0] == out
    assert off.generate(GenerationRequest(second, greedy(6)), timeout=120)[0] == again
    settle(off)


def test_dflash2_ring_taps_equal_split_taps(model):
    """DFlash2's ring taps (spec §7.3): the ring of an image a pass took inside itself is the ring
    a pass ending at the tap leaves, slot for slot, with the window wrapping inside the pass (a
    window of 64 positions, taps at 37, 150 and 291 in passes of 256 and 44 tokens)."""
    from hpc_cli.engine.api import TapHint
    from hpc_cli.speculative.dflash import RING_PART

    prompt = tokens(300, seed=22)
    hints = [TapHint(37, 3), TapHint(150, 1), TapHint(291, 2)]
    import copy

    from hpc_cli import plugins

    small = copy.copy(plugins.spec_backend("dflash2"))
    small.ring_window = 64  # the passes wrap round the ring
    rings = {}
    for mode in ("split", "in pass"):
        e = tap_engine(model, small, split=mode == "split")
        try:
            e.generate(GenerationRequest(prompt, greedy(4), tap_hints=hints), timeout=120)
            assert e.cache.counters["taps_in_pass"] == (0 if mode == "split" else 3), e.cache.counters
            snaps = {s.frontier: e.cache.snap_phys[s.device_slot] for s in e.cache.index.snapshots.values()
                     if s.device_slot >= 0 and s.frontier in (37, 150, 291)}
            rings[mode] = {p: e.states.extra[RING_PART][slot].float().clone() for p, slot in snaps.items()}
        finally:
            e.stop()
        e.check_invariants()
    assert set(rings["in pass"]) == set(rings["split"]) == {150, 291}, (rings["in pass"].keys(), rings["split"].keys())
    for p in rings["split"]:
        a, b = rings["in pass"][p], rings["split"][p]
        assert b.abs().sum() > 0, f"the ring at {p} is empty"
        # the features come from passes of other lengths: a few values a bf16 rounding apart
        assert (a != b).float().mean() < 0.01, f"ring at {p}: {(a != b).sum()} values differ"
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"ring at {p}")
