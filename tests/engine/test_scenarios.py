"""Spec §13.3 scenarios that apply to one device, run on CPU with builtin:random.

Scenarios that apply to several cache modes run in each (``mode``: hybrid and legacy, the
checkpoint catalog; ``off`` is the reference every equality test compares with). Every test ends
with ``settle``: engine.stop(), check_invariants(), and nothing left held (the binding's
``leftovers``: pins, sequences, active or filling pages, lanes, transfers). Equality tests use
greedy sampling with ignore_eos.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.engine.api import GenerationRequest, TapHint, to_json
from hpc_cli.engine.engine import Engine
from hpc_cli.memory.transfer.fake import FakeTransferEngine


import random

from hpc_cli.engine.api import SamplingParams


def tokens(n: int, seed: int) -> list[int]:
    """A reproducible prompt of ``n`` ids in the byte range (no EOS/special ids)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(engine: Engine, prompt: list[int], max_tokens: int = 8, *, sampling: SamplingParams | None = None,
        **kw):
    toks, fin = engine.generate(GenerationRequest(list(prompt), sampling or greedy(max_tokens), **kw), timeout=120)
    assert fin.reason in ("length", "stop"), (fin.reason, fin.error)
    return toks, fin


#: the modes the shared scenarios run in (off is every equality test's reference)
MODES = ["hybrid", "legacy"]


def make(model, mode: str = "hybrid", **kw) -> Engine:
    kw.setdefault("kv_pages", 64)
    kw.setdefault("prefill_chunk", 128)
    kw.setdefault("max_concurrency", 2)
    return Engine(model, cache_mode=mode, **kw).start()


def opts(mode: str, *, slots: int | None = None, spacing: int | None = None, anchors: int | None = None) -> dict:
    """The same intent in each mode's options: state slots for snapshots or checkpoints, and the
    spacing of the hybrid ladder or of legacy's long anchors (with a minimum gap of 64)."""
    if mode == "hybrid":
        return {k: v for k, v in {"snapshot_slots": slots, "tap_ladder_tokens": spacing,
                                  "tap_min_gap_tokens": 64 if spacing else None,
                                  "max_new_taps": anchors}.items() if v is not None}
    options = {"device_state_slots": slots, "long_anchor_spacing": spacing, "max_long_anchors_per_continuation": anchors}
    return {"cache_options": {k: v for k, v in options.items() if v is not None}}


def frontiers(engine: Engine) -> list[int]:
    """The frontiers a request can resume at: live snapshots (hybrid) or checkpoints (legacy)."""
    cache = engine.cache
    if cache.mode == "hybrid":
        return sorted(s.frontier for s in cache.index.snapshots.values() if s.alive)
    return sorted(c.frontier for o in cache.catalog.owners.values() for c in o.checkpoints)


def settle(engine: Engine, *, fatal_ok: bool = False) -> dict:
    """Stop the engine, walk the invariants and check nothing is held (the binding's leftovers:
    no pins, no sequences, no active or filling pages, every lane slot back, no transfer in
    flight). Returns the hybrid index's stats, or the binding's stats in other modes."""
    engine.stop()
    engine.check_invariants()
    if not fatal_ok:
        assert engine.fatal is None, engine.fatal
    cache = engine.cache
    held = {k: v for k, v in cache.leftovers().items() if v}
    assert not held, held
    return to_json(cache.index.stats() if cache.mode == "hybrid" else cache.stats())


PROFILES = ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]


def floor64(x: int) -> int:
    return x - x % BLOCK_TOKENS


def first_logprobs(engine, prompt, n):
    toks, fin = engine.submit(GenerationRequest(list(prompt), greedy(n, logprobs=20))).result(timeout=120)
    assert fin.reason == "length", (fin.reason, fin.error)
    return [t.token_id for t in toks], dict(toks[0].top_logprobs), fin


def lp_diff(a: dict, b: dict) -> float:
    keys = set(a) & set(b)
    assert len(keys) >= 10
    return max(abs(a[k] - b[k]) for k in keys)


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- resume-equivalence
# every KV profile in hybrid; legacy keeps its pages in the same pools, so two profiles show it
@pytest.mark.parametrize("profile,mode", [(p, "hybrid") for p in PROFILES] + [("bf16", "legacy"), ("k8v4", "legacy")])
def test_resume_equivalence(model, profile, mode):
    from hpc_cli import plugins

    try:
        plugins.kv_profile(profile).quantize(torch.zeros(1, 64, 1, 64), "k")
    except NotImplementedError:
        pytest.skip(f"{profile}: quantize not implemented on this host")
    except Exception:
        pass
    base = tokens(230, seed=1)
    full = base + tokens(45, seed=2)
    N = 64
    # roots: the same prompt from the root with two chunk decompositions (the baseline)
    roots = []
    for chunk in (128, 48):
        e = make(model, kv_profile=profile, reuse=False, prefill_chunk=chunk, kv_pages=32)
        roots.append(first_logprobs(e, full, N))
        settle(e)
    (r_toks, r_lp, _), (b_toks, b_lp, _) = roots
    base_diff = lp_diff(r_lp, b_lp)
    base_agree = agreement(r_toks, b_toks)
    # resumed: warm the cache with the shorter prompt, then extend it
    e = make(model, mode, kv_profile=profile, prefill_chunk=128, kv_pages=32, host_cache_mib=16)
    run(e, base, 1)
    s_toks, s_lp, fin = first_logprobs(e, full, N)
    assert fin.usage.reuse_tokens >= floor64(len(base) - 1), fin.usage
    assert fin.usage.prefill_tokens == len(full) - fin.usage.reuse_tokens
    d = lp_diff(r_lp, s_lp)
    assert d <= max(4 * base_diff, 1e-3), (profile, d, base_diff)
    assert agreement(r_toks, s_toks) >= min(base_agree, N), (profile, s_toks, r_toks, base_agree)
    settle(e)


# ----------------------------------------------------------------------------- multi-turn endpoint
@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_exact_endpoint_reuse(model, mode):
    e = make(model, mode, host_cache_mib=16)
    ops = {"copy_page": 0, "copy_slot": 0}
    storage, states = e.cache.storage, e.cache.states
    orig_page, orig_slot = storage.copy_page, states.copy_slot

    def count(name, fn):
        def wrapper(*a, **k):
            ops[name] += 1
            return fn(*a, **k)
        return wrapper

    storage.copy_page = count("copy_page", orig_page)
    states.copy_slot = count("copy_slot", orig_slot)
    seen = {}
    orig_finish = e.cache.finish

    def finish(lane, **kw):
        before = dict(ops)
        d = lane.pos // BLOCK_TOKENS
        seen.update(pos=lane.pos, tail_page=lane.pages[d], slot=lane.state_slot)
        orig_finish(lane, **kw)
        seen["finish_copies"] = {k: ops[k] - before[k] for k in ops}

    e.cache.finish = finish
    prompt = tokens(150, seed=3)
    for turn in range(3):
        # F_end - (deepest snapshot on the path) >= 64 is needed for an endpoint (spec §7.7)
        gen, fin = run(e, prompt, 80)
        if turn:
            assert fin.usage.reuse_tokens == f_end, (turn, fin.usage, f_end)
        f_end = seen["pos"]
        assert f_end == len(prompt) + len(gen) - 1
        assert f_end in frontiers(e)
        if mode == "hybrid":
            # the endpoint took the active image and the partial page without a copy
            assert seen["finish_copies"] == {"copy_page": 0, "copy_slot": 0}, seen
            ends = [s for s in e.cache.index.snapshots.values() if s.kind is SnapshotKind.ENDPOINT
                    and s.frontier == f_end and s.alive]
            assert len(ends) == 1
            assert ends[0].tail_pages == (seen["tail_page"],)
            assert e.cache.snap_phys[ends[0].device_slot] == seen["slot"]
        else:  # the session's continuation moved on: one, its endpoint the deepest checkpoint
            assert e.cache.stats().catalog.private_continuations == 1
        prompt = prompt + gen + tokens(30, seed=10 + turn)
    # the reference: the last prompt from the root gives the same greedy output
    last, _ = run(e, prompt, 20)
    st = settle(e)
    if mode == "hybrid":
        assert st["counters"]["published"]["endpoint"] >= 3
    else:
        assert st["catalog"]["counters"]["published_endpoints"] >= 3
    off = make(model, reuse=False)
    ref, fin = run(off, prompt, 20)
    assert fin.usage.reuse_tokens == 0
    settle(off)
    assert last == ref


# ----------------------------------------------------------------------------- re-rendered history
def test_rerendered_history_reuses_opener_tap(model):
    e = make(model, host_cache_mib=16)
    system_user = tokens(170, seed=4)
    opener = [200, 201, 202]
    p1 = system_user + opener
    n1 = len(p1)
    gen, _ = run(e, p1, 12, tap_hints=[TapHint(n1 - len(opener), 2)])
    # turn 2: the assistant turn is re-rendered (thinking stripped: different tokens)
    rerendered = [203] + gen[5:] + [204]
    p2 = p1 + rerendered + tokens(40, seed=5) + opener
    _, fin = run(e, p2, 4)
    assert fin.usage.reuse_tokens >= floor64(n1 - 1), (fin.usage, n1)
    settle(e)


# ----------------------------------------------------------------------------- deep edit
@pytest.mark.parametrize("mode", MODES)
def test_deep_edit_reuses_deepest_ladder_tap(model, mode):
    """An edit deep in the prompt resumes at the deepest snapshot (hybrid's ladder taps) or long
    anchor (legacy) below it."""
    e = make(model, mode, host_cache_mib=16, kv_pages=64, **opts(mode, spacing=128, anchors=8, slots=8))
    p = tokens(700, seed=6)
    run(e, p, 2)
    points = frontiers(e)
    ladder = [f for f in points if f < len(p) - BLOCK_TOKENS]
    assert len(ladder) >= 3, points
    edit = 400
    edited = list(p)
    edited[edit] = (edited[edit] % 249) + 1
    expect = max(f for f in points if f <= edit)
    assert expect > 0
    out, fin = run(e, edited, 6)
    assert fin.usage.reuse_tokens == expect, (fin.usage, points)
    settle(e)
    off = make(model, reuse=False)
    ref, _ = run(off, edited, 6)
    settle(off)
    assert out == ref


# ----------------------------------------------------------------------------- shared preamble
@pytest.mark.parametrize("mode", MODES)
def test_shared_preamble_stored_once_all_hit(model, mode):
    """Hybrid: one request's preamble serves all eight sessions, stored once. Legacy: the first
    session that shares it with another publishes it as a shared stable prefix (a capture at the
    divergence), and the other seven resume there."""
    e = make(model, mode, host_cache_mib=16, max_concurrency=8, kv_pages=64)
    pre = tokens(256, seed=7)
    run(e, pre + [9], 1, tap_hints=[TapHint(256, 3)])
    if mode == "hybrid":
        assert e.cache.index.stats().nodes.total == 4
    handles = [e.submit(GenerationRequest(pre + tokens(70, seed=100 + i), greedy(4))) for i in range(8)]
    fins = [h.result(timeout=120)[1] for h in handles]
    hits = [f.usage.reuse_tokens >= 256 for f in fins]
    if mode == "legacy":
        assert sum(hits) == 7 and not hits[0], [f.usage.reuse_tokens for f in fins]
        st = settle(e)
        assert st["catalog"]["shared_prefixes"] == 1 and st["catalog"]["counters"]["published_shared"] == 1, st
        return
    assert all(hits), [f.usage.reuse_tokens for f in fins]
    st = settle(e)
    # each session's own blocks: floor((256 + 70 + 3) / 64) - 4 = 1; the preamble's 4 once
    assert st["nodes"]["total"] == 4 + 8, st["nodes"]
    assert st["counters"]["commits"].get("duplicate", 0) == 0, st["counters"]["commits"]
    assert st["device"]["cached_page_bundles"] >= 12


def test_prompts_leaving_a_cached_path_are_tapped_where_they_leave(model):
    """Hybrid, raw prompts sharing a prefix that nothing marks (few-shot completions): the first
    prompt is tapped at its own tail only, so the second, leaving its path at 704, finds the
    blocks but no state there and recomputes them; it taps the deepest cached block boundary as a
    Boundary snapshot, and every later prompt sharing the prefix resumes from it, answering as a
    cold prefill does. Before, every such prompt recomputed the shared prefix."""
    pre = tokens(740, seed=11)
    prompts = [pre + tokens(90 + 13 * i, seed=30 + i) for i in range(5)]
    e = make(model, "hybrid", host_cache_mib=16, kv_pages=96)
    fins = [run(e, p, 6) for p in prompts]
    reuse = [f.usage.reuse_tokens for _, f in fins]
    cached = [f.usage.cached_prefix_tokens for _, f in fins]
    assert cached == [0, 704, 704, 704, 704], cached
    assert reuse == [0, 0, 704, 704, 704], reuse
    st = settle(e)
    assert st["snapshots"]["by_kind"].get("boundary", 0) == 1, st["snapshots"]
    cold = make(model, "hybrid", reuse=False, kv_pages=96)
    for (toks, _), p in zip(fins[2:], prompts[2:]):
        assert agreement(toks, run(cold, p, 6)[0]) >= 4
    settle(cold)


# ----------------------------------------------------------------------------- host-only helpers
def _push_out(e, n_fill: int = 3, seed: int = 50):
    """Run unrelated prompts until the device copies of earlier entries are evicted."""
    for i in range(n_fill):
        run(e, tokens(300, seed=seed + i), 2)


def _host_only_engine(model, mode: str = "hybrid", **kw):
    kw.setdefault("kv_pages", 12)
    kw.setdefault("host_cache_mib", 32)
    kw.setdefault("max_concurrency", 1)
    return make(model, mode, **opts(mode, slots=1), **kw)


#: output tokens of the first request: a legacy session endpoint is a prefix of the extended
#: prompt only when no generated token was processed (hybrid resumes at its prompt-tail tap)
FIRST_GEN = {"hybrid": 2, "legacy": 1}


@pytest.mark.parametrize("mode", MODES)
def test_host_only_restore_matches_device_resume(model, mode):
    p = tokens(300, seed=8)
    ext = p + tokens(40, seed=9)
    dev = make(model, mode, host_cache_mib=32, kv_pages=32)
    run(dev, p, FIRST_GEN[mode])
    want, fin_d = run(dev, ext, 16)
    assert fin_d.usage.reuse_tokens > 0 and fin_d.usage.restored_host_bytes == 0
    settle(dev)

    e = _host_only_engine(model, mode)
    run(e, p, FIRST_GEN[mode])
    _push_out(e)
    got, fin = run(e, ext, 16)
    assert fin.usage.reuse_tokens == fin_d.usage.reuse_tokens, (fin.usage, fin_d.usage)
    assert fin.usage.restored_host_bytes > 0, fin.usage
    assert got == want
    st = settle(e)
    if mode == "hybrid":
        assert st["counters"]["restores"] >= 1
    else:
        assert st["catalog"]["counters"]["demoted"] >= 1 and st["restored_host_bytes"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_concurrency_8_identical_prompts(model, mode):
    p = tokens(300, seed=11)
    ext = p + tokens(30, seed=12)
    ref_e = make(model, reuse=False, kv_pages=16)
    ref, _ = run(ref_e, ext, 8)
    settle(ref_e)

    e = _host_only_engine(model, mode, kv_pages=24, max_concurrency=8, concurrent_prefill=True)
    run(e, p, FIRST_GEN[mode])
    # fill the device pool and the one snapshot slot with other entries
    for i in range(6):
        run(e, tokens(300, seed=60 + i), 2)
    handles = [e.submit(GenerationRequest(list(ext), greedy(8))) for _ in range(8)]
    results = [h.result(timeout=120) for h in handles]
    for toks, fin in results:
        assert fin.reason == "length", fin.error
        assert [t.token_id for t in toks] == ref
    st = settle(e)
    if mode == "legacy":  # the lanes admitted first restore their own copy of the host checkpoint
        first = results[0][1].usage  # (the first to finish replaces it: a continuation has one owner)
        assert first.reuse_tokens == len(p) and first.restored_host_bytes > 0, first
        return
    restored = [fin.usage.restored_host_bytes for _, fin in results]
    # every request restores the snapshot image into its own lane slot (in place); the
    # host-only blocks are restored once: no double restore of a Filling node
    img = e.cache.image_bytes
    block_restores = [r for r in restored if r > img]
    assert restored[0] > img, restored
    assert len(block_restores) == 1, (restored, img)


# ----------------------------------------------------------------------------- cancellation
class _CancelAfter:
    """A model proxy whose prefill cancels a request after ``n`` passes."""

    def __init__(self, model, n):
        self._m, self.n, self.handle, self.calls = model, n, None, 0

    def __getattr__(self, k):
        return getattr(self._m, k)

    def prefill(self, *a, **k):
        out = self._m.prefill(*a, **k)
        self.calls += 1
        if self.calls == self.n and self.handle is not None:
            self.handle.cancel()
        return out


@pytest.mark.parametrize("mode", MODES)
def test_cancel_mid_prefill_publishes_taps_and_blocks(model, mode):
    """A request cancelled mid-prefill leaves what it computed: its blocks and taps (hybrid), or
    a continuation with an endpoint where it stopped (legacy); the rerun resumes there."""
    e = Engine(model, kv_pages=32, prefill_chunk=64, max_concurrency=1, host_cache_mib=16, cache_mode=mode,
               **opts(mode, spacing=128, anchors=8 if mode == "legacy" else None))
    proxy = _CancelAfter(model, 5)
    e.model = proxy
    e.start()
    p = tokens(700, seed=13)
    h = e.submit(GenerationRequest(list(p), greedy(4)))
    proxy.handle = h
    toks, fin = h.result(timeout=120)
    assert fin.reason == "cancelled" and not toks
    done = fin.usage.prefill_tokens
    assert 0 < done < len(p)
    if mode == "hybrid":
        assert e.cache.index.stats().nodes.total == done // BLOCK_TOKENS
    points = frontiers(e)
    assert points and max(points) <= done
    proxy.handle = None
    out, fin2 = run(e, p, 4)
    assert fin2.usage.reuse_tokens == max(points), (fin2.usage, points)
    settle(e)
    off = make(model, reuse=False, kv_pages=16)
    ref, _ = run(off, p, 4)
    settle(off)
    assert out == ref


# ----------------------------------------------------------------------------- pressure
@pytest.mark.parametrize("mode", MODES)
def test_pressure_with_active_growth(model, mode):
    e = make(model, mode, host_cache_mib=16, kv_pages=16, max_concurrency=2)
    for i in range(4):  # fill the pool with cached entries
        run(e, tokens(200, seed=20 + i), 2)
    assert e.cache.pool.counts().cached > 4
    pa, pb = tokens(180, seed=30), tokens(150, seed=31)
    ha = e.submit(GenerationRequest(pa, greedy(200)))  # grows to ceil(380/64) = 6 pages
    hb = e.submit(GenerationRequest(pb, greedy(200)))  # 6 pages
    (ta, fa), (tb, fb) = ha.result(timeout=300), hb.result(timeout=300)
    assert fa.reason == fb.reason == "length", (fa.error, fb.error)
    st = settle(e)
    if mode == "hybrid":
        assert st["counters"]["device_evictions_backed"] + st["counters"]["device_evictions_unbacked"] > 0
    else:
        assert st["catalog"]["counters"]["demoted"] + st["catalog"]["counters"]["evicted"] > 0
    off = make(model, reuse=False, kv_pages=16)
    assert [t.token_id for t in ta] == run(off, pa, 200)[0]
    assert [t.token_id for t in tb] == run(off, pb, 200)[0]
    settle(off)


# ----------------------------------------------------------------------------- host cache 0
@pytest.mark.parametrize("mode", MODES)
def test_host_cache_zero_device_only(model, mode):
    e = make(model, mode, host_cache_mib=0, kv_pages=12, max_concurrency=1,
             **(opts(mode, spacing=128) if mode == "legacy" else {}))
    p = tokens(200, seed=40)
    run(e, p, 4)
    out, fin = run(e, p + tokens(20, seed=41), 4)
    assert fin.usage.reuse_tokens > 0 and fin.usage.restored_host_bytes == 0
    assert e.cache.host.num_slabs == 0 and e.cache.residency().host_bytes == 0
    _push_out(e, 3, seed=42)  # unbacked evictions delete subtrees (legacy: drop whole owners)
    out2, fin2 = run(e, p + tokens(20, seed=41), 4)
    assert out2 == out
    st = settle(e)
    if mode == "legacy":
        assert st["catalog"]["counters"]["evicted"] > 0 and st["catalog"]["counters"]["demoted"] == 0
        return
    assert st["counters"]["device_evictions_unbacked"] > 0
    assert st["counters"]["nodes_deleted"] > 0


# ----------------------------------------------------------------------------- disabled / off
@pytest.mark.parametrize("mode", MODES)
def test_disabled_requests_leave_nothing(model, mode):
    e = make(model, mode, host_cache_mib=16)
    run(e, tokens(150, seed=43), 4)
    held0 = e.cache.residency()
    p = tokens(200, seed=44)
    for _ in range(2):
        _, fin = run(e, p, 4, cache_enabled=False)
        assert fin.usage.reuse_tokens == 0
    st1 = settle(e)
    assert e.cache.residency() == held0
    if mode == "hybrid":
        assert st1["nodes"]["total"] == e.cache.index.stats().nodes.total


def test_cache_mode_off_never_reuses(model):
    from hpc_cli.settings import load_settings

    r = load_settings(None, {"cache.mode": "off", "engine.prefill_chunk": 128, "engine.max_concurrency": 2,
                             "engine.kv_capacity": 32, "model.name": "builtin:random"}, environ={})
    e = Engine.from_settings(r).start()
    p = tokens(200, seed=45)
    outs = []
    for _ in range(3):
        toks, fin = run(e, p, 4)
        assert fin.usage.reuse_tokens == 0 and fin.usage.cached_prefix_tokens == 0
        assert fin.usage.prefill_tokens == len(p)
        outs.append(toks)
    assert outs[0] == outs[1] == outs[2]
    st = settle(e)
    assert e.cache.mode == "off" and st["residency"]["entries"] == 0 and st["pool"]["cached"] == 0


# ----------------------------------------------------------------------------- fault injection
class _FaultyTransfer(FakeTransferEngine):
    """Completes every job at submission (like the synchronous CPU path) except that the first
    job of kind ``fail_kind`` fails with an injected error."""

    fail_kind: str | None = None

    def _submit(self, job):
        super()._submit(job)
        if self.fail_kind is not None and job.kind == self.fail_kind:
            self.fail_kind = None
            self.fail(job.job_id, f"injected {job.kind} fault")
        else:
            self.complete(job.job_id)


def _fake_engine(model, holder, **kw):
    def factory(*a, **k):
        holder.append(_FaultyTransfer(*a, **k))
        return holder[0]

    kw.setdefault("kv_pages", 12)
    kw.setdefault("snapshot_slots", 1)
    kw.setdefault("host_cache_mib", 32)
    kw.setdefault("max_concurrency", 1)
    return make(model, transfer_factory=factory, **kw)


def _wait_for(cond, timeout=30):
    import time

    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_fault_failed_write_fails_engine_without_pins(model):
    holder: list = []
    e = _fake_engine(model, holder)
    holder[0].fail_kind = "write"  # the first write-through: a tap's image, mid-request
    _, fin = e.submit(GenerationRequest(tokens(200, seed=46), greedy(2))).result(timeout=120)
    assert fin.reason == "error" and "write transfer" in fin.error and "injected" in fin.error, fin
    assert _wait_for(lambda: e.fatal is not None)
    assert "injected write fault" in e.fatal
    with pytest.raises(Exception, match="stopped after an error"):
        e.submit(GenerationRequest(tokens(10, seed=1), greedy(1)))
    settle(e, fatal_ok=True)


def test_fault_failed_restore_fails_engine_without_pins(model):
    holder: list = []
    e = _fake_engine(model, holder)
    p = tokens(300, seed=47)
    run(e, p, 2)
    _push_out(e, 3, seed=70)  # the first entry is now host-only
    holder[0].fail_kind = "restore"
    toks, fin = e.submit(GenerationRequest(p + tokens(20, seed=48), greedy(4))).result(timeout=120)
    assert holder[0].fail_kind is None, "no restore was issued"
    assert _wait_for(lambda: e.fatal is not None)
    assert "injected restore fault" in e.fatal
    assert fin.reason == "error" and "restore" in (fin.error or ""), (fin.reason, fin.error)
    settle(e, fatal_ok=True)
