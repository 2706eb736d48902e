"""Per-request phase timing (usage.timing): every phase non-negative, disjoint (their sum stays
within the request's wall time), one entry per prefill pass, taps counted where snapshots were
taken, and restore waits timed only for requests that restore from the host tier."""

from __future__ import annotations

import random
import time

from hpc_cli.engine.api import PHASES, FinishEvent, GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def _timed_run(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[FinishEvent, float]:
    t0 = time.monotonic()
    _, fin = engine.generate(GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=True)), timeout=120)
    wall = time.monotonic() - t0
    assert fin.reason == "length", (fin.reason, fin.error)
    return fin, wall


def _check_disjoint(fin: FinishEvent, wall: float) -> dict[str, float]:
    phases = fin.usage.timing.phases()
    assert set(phases) == set(PHASES)
    assert all(v >= 0.0 for v in phases.values()), phases
    assert sum(phases.values()) <= wall, (phases, wall)
    return phases


def test_phases_passes_and_taps(model):
    e = Engine(model, kv_pages=64, prefill_chunk=128, max_concurrency=2, host_cache_mib=16,
               tap_ladder_tokens=128, tap_min_gap_tokens=64, max_new_taps=8).start()
    try:
        fin, wall = _timed_run(e, _tokens(700, seed=1), 6)
    finally:
        e.stop()
    t, u = fin.usage.timing, fin.usage
    phases = _check_disjoint(fin, wall)
    assert len(t.passes) >= 700 // 128 and sum(p.tokens for p in t.passes) == u.prefill_tokens == 700
    assert all(p.seconds > 0 and 0 < p.tokens <= 128 for p in t.passes)
    assert t.taps >= 3 and phases["tap"] > 0  # the ladder's snapshot copies
    assert phases["decode"] > 0 and phases["finish"] > 0  # 5 decode rounds; endpoint snapshot + release
    assert phases["restore_wait"] == 0.0  # nothing restored
    assert phases["admission"] == u.queue_seconds <= u.time_to_first_token


def test_restore_wait_only_for_host_restores(model):
    e = Engine(model, kv_pages=12, prefill_chunk=128, max_concurrency=1, snapshot_slots=1,
               host_cache_mib=32).start()
    try:
        p = _tokens(300, seed=8)
        first, wall = _timed_run(e, p, 2)
        _check_disjoint(first, wall)
        for i in range(3):  # evict the device copies: only the host tier keeps p
            _timed_run(e, _tokens(300, seed=50 + i), 2)
        fin, wall = _timed_run(e, p + _tokens(40, seed=9), 4)
    finally:
        e.stop()
    assert first.usage.timing.restore_wait == 0.0
    assert fin.usage.restored_host_bytes > 0 and fin.usage.reuse_tokens > 0
    phases = _check_disjoint(fin, wall)
    assert phases["restore_wait"] > 0  # the first pass's per-layer waits, timed on the host
    assert sum(p.tokens for p in fin.usage.timing.passes) == fin.usage.prefill_tokens


def test_zero_max_tokens_has_no_decode(model):
    e = Engine(model, kv_pages=32, prefill_chunk=128, max_concurrency=1).start()
    try:
        fin, wall = _timed_run(e, _tokens(200, seed=3), 0)
    finally:
        e.stop()
    phases = _check_disjoint(fin, wall)
    assert phases["decode"] == 0.0 and fin.usage.completion_tokens == 0
    # chunks of 128; the exact tail tap floor64(199) = 192 is taken inside the second pass on the
    # CPU (no split), and the snapshot is there
    assert [p.tokens for p in fin.usage.timing.passes] == [128, 72]
    assert fin.usage.timing.taps == 1
