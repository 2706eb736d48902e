"""Cache mode legacy on CUDA: a device resume, a demotion to the host (copy before release) and a
host restore (blocks and the image, layer by layer) give the same greedy output as a cold prefill."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("profile", ["bf16", "int8-g64"])
def test_cuda_legacy_resume_demote_restore_match_cold(profile):
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, device="cuda")
    kw = dict(kv_profile=profile, kv_pages=200, prefill_chunk=256, max_model_len=8192, max_concurrency=2)
    base = list(range(10, 250)) * 6  # 1440 tokens
    ext = base + list(range(30, 90))
    one, sp = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=24, temperature=0)
    off = Engine(model, reuse=False, **kw).start()
    try:
        cold, _ = off.generate(GenerationRequest(ext, sp))
    finally:
        off.stop()
    eng = Engine(model, cache_mode="legacy", host_cache_mib=256, cache_options={"device_state_slots": 1}, **kw).start()
    try:
        eng.generate(GenerationRequest(base, one))
        resumed, f1 = eng.generate(GenerationRequest(ext, sp))  # the session endpoint on the device
        eng.generate(GenerationRequest(base, one))  # a new session there: the continuation above demotes
        eng.generate(GenerationRequest([(7 * i) % 250 + 1 for i in range(1500)], one))
        restored, f2 = eng.generate(GenerationRequest(ext, sp))
    finally:
        eng.stop()
    assert eng.fatal is None
    eng.check_invariants()
    assert not any(eng.cache.leftovers().values())

    def agree(a, b):
        return sum(x == y for x, y in zip(a, b)) / len(a)

    assert f1.usage.reuse_tokens == len(base) and f1.usage.restored_host_bytes == 0
    assert f2.usage.reuse_tokens == len(base) and f2.usage.restored_host_bytes > 0, f2.usage
    assert eng.cache.stats().catalog.counters.demoted >= 1
    assert resumed[:8] == cold[:8] and agree(resumed, cold) >= 0.9
    assert restored[:8] == cold[:8] and agree(restored, cold) >= 0.9
