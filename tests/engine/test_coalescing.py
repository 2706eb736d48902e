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
    assert stats.nodes.pinned == 0 and stats.sequences == 0
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


def test_prompt_logprobs_prefill_from_root_and_match_a_full_forward(model):
    """Echo logprobs (lm-evaluation-harness) need logits at every prompt position: such a request
    resumes nothing even when the prefix is cached, and its logprobs equal one full forward."""
    import torch

    eng = Engine(model, kv_profile="bf16", max_concurrency=2, prefill_chunk=64, kv_pages=200,
                 host_cache_mib=32, max_model_len=4096).start()
    p = list(range(20, 220))
    try:
        eng.generate(GenerationRequest(p, SamplingParams(max_tokens=3, temperature=0)))
        _, fin = eng.generate(GenerationRequest(p, SamplingParams(max_tokens=0, prompt_logprobs=True, logprobs=2)))
    finally:
        eng.stop()
    eng.check_invariants()
    assert fin.usage.reuse_tokens == 0 and fin.reason == "length"
    full = torch.log_softmax(model.forward_tokens(p).float(), -1)
    assert len(fin.prompt_logprobs) == len(p) and fin.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        assert abs(fin.prompt_logprobs[i] - float(full[i - 1, p[i]])) < 1e-4
        top = fin.prompt_top_logprobs[i]
        assert top[0][0] == int(full[i - 1].argmax()) and len(top) == 2
