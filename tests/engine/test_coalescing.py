"""In-flight prefix coalescing (spec §12.2): a request sharing a new prefix with a lane still
prefilling waits for the sibling's snapshot at the divergence instead of prefilling it again."""

from __future__ import annotations

import random

import pytest

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine


def _engine(model, coalesce: bool) -> Engine:
    return Engine(model, kv_profile="bf16", max_concurrency=4, prefill_chunk=128, kv_pages=256,
                  host_cache_mib=32, concurrent_prefill=True, coalesce=coalesce, max_model_len=4096)


def _prompts():
    rng = random.Random(7)
    shared = [rng.randrange(1, 250) for _ in range(700)]
    return [shared + [rng.randrange(1, 250) for _ in range(40)] for _ in range(3)]


def _run(model, coalesce: bool):
    eng = _engine(model, coalesce).start()
    try:
        handles = [eng.submit(GenerationRequest(p, SamplingParams(max_tokens=4, temperature=0)))
                   for p in _prompts()]
        results = [h.result(timeout=300) for h in handles]
    finally:
        eng.stop()
    eng.check_invariants()
    stats = eng.cache.index.stats()
    assert stats["nodes"]["pinned"] == 0 and stats["sequences"] == 0
    return eng, [[t.token_id for t in toks] for toks, _ in results], [fin.usage for _, fin in results]


@pytest.mark.parametrize("coalesce", [True])
def test_coalescing_waits_for_the_sibling_and_reuses_the_shared_prefix(model, coalesce):
    eng, outs, usage = _run(model, coalesce=True)
    base_eng, base_outs, base_usage = _run(model, coalesce=False)
    assert outs == base_outs, "coalescing changed the output"
    # Without coalescing the siblings arrive together and each prefills the shared 700 tokens.
    assert sum(u.prefill_tokens for u in base_usage) >= 3 * 700
    # With it the later two resume from the sibling's snapshot at the divergence (640 = floor64(700)).
    assert usage[0].reuse_tokens == 0
    assert all(u.reuse_tokens >= 640 for u in usage[1:]), [u.reuse_tokens for u in usage]
    assert sum(u.prefill_tokens for u in usage) < sum(u.prefill_tokens for u in base_usage) - 1000
    assert eng.cache.counters["coalesce_waits"] > 0
    assert base_eng.cache.counters["coalesce_waits"] == 0
