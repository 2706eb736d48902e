"""Prefetching the blocked FIFO head (spec §6.6): while the head waits for a lane, its host-only
path blocks are copied into spare device pages, so its admission restores only the rest."""

from __future__ import annotations

import random

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def test_blocked_head_path_is_prefetched_and_admission_restores_less(model):
    eng = Engine(model, kv_profile="bf16", max_concurrency=1, prefill_chunk=256, kv_pages=40,
                 host_cache_mib=32, max_model_len=4096).start()
    try:
        long = _prompt(1, 900)
        sp = SamplingParams(max_tokens=2, temperature=0)
        eng.generate(GenerationRequest(long, sp))  # cached: 14 blocks, written through to host
        # Another conversation fills the device pool, pushing the first one's blocks out (host-backed).
        eng.generate(GenerationRequest(_prompt(2, 1500), sp))
        before = eng.cache.counters["prefetched_blocks"]
        # A long request occupies the only lane while the revisit of the first prompt waits.
        busy = eng.submit(GenerationRequest(_prompt(3, 300), SamplingParams(max_tokens=40, temperature=0)))
        revisit = eng.submit(GenerationRequest(long + [5, 6, 7], sp))
        busy.result(timeout=300)
        toks, fin = revisit.result(timeout=300)
    finally:
        eng.stop()
    eng.check_invariants()
    prefetched = eng.cache.counters["prefetched_blocks"] - before
    assert prefetched > 0, "the waiting head's host-only path was not prefetched"
    assert fin.usage.reuse_tokens >= 896 - 64
    # The prefetched blocks were device-resident at admission: the revisit restored fewer bytes
    # than its whole path.
    block_bytes = eng.cache.layout.record_bytes
    assert fin.usage.restored_host_bytes <= (fin.usage.reuse_tokens // 64 - prefetched) * block_bytes \
        + eng.cache.image_bytes + block_bytes
    stats = eng.cache.index.stats()
    assert stats.nodes.pinned == 0 and stats.sequences == 0
