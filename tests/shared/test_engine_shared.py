"""The shared tier between engines in one process (builtin:random on the CPU, a real redis-server):
an engine that never saw a prompt resumes it from what another engine wrote, with the same
greedy output as a cold engine; damaged, foreign or unreachable values are misses."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from hpc_cli.cache.host import SlabUse
from hpc_cli.cache.records import ADOPTING
from hpc_cli.cache.shared import ROOT_PATH, BlockEntry
from hpc_cli.engine import shared as shared_mod
from hpc_cli.engine.shared import find as shared_find
from hpc_cli.engine.shared.writer import SlabRead, Write
from hpc_cli.engine.api import GenerationRequest, SamplingParams, to_json
from hpc_cli.engine.engine import Engine
from hpc_cli.engine.shared import attach_shared_cache

from .redis_proc import free_port


@pytest.fixture(scope="module")
def model():
    from hpc_cli.model.model import HybridModel

    torch.manual_seed(0)
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def make(model, url: str | None, timeout_ms: int = 2000) -> Engine:
    e = Engine(model, kv_pages=96, prefill_chunk=128, max_concurrency=2, host_cache_mib=16)
    if url is not None:
        attach_shared_cache(e, url, timeout_ms=timeout_ms)
    return e.start()


def run(engine: Engine, prompt: list[int], n: int = 6):
    toks, fin = engine.generate(GenerationRequest(list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True)), timeout=120)
    assert fin.reason == "length", (fin.reason, fin.error)
    return toks, fin.usage


def settle(engine: Engine) -> dict:
    tier = engine.cache.shared
    if tier is not None:
        tier.flush()
    engine.stop()
    engine.check_invariants()
    assert engine.fatal is None
    return to_json(tier.stats()) if tier is not None else {}


def _redis_values(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url)


def test_a_fresh_engine_resumes_from_the_shared_tier_exactly(model, redis_server):
    first = tokens(700, 1)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    sa = settle(a)
    assert sa["writes_stored"] >= 11 and sa["misses"].get("no_entry", 0) == 1  # 10 blocks, the endpoint
    follow = first + out_a + tokens(90, 2)
    b = make(model, redis_server.url)
    out_b, usage = run(b, follow)
    assert usage.reuse_tokens == len(first) + len(out_a) - 1  # the endpoint of the first turn
    cold = make(model, None)
    out_c, cold_usage = run(cold, follow)
    settle(cold)
    assert cold_usage.reuse_tokens == 0 and out_b == out_c  # never wrong data
    sb = settle(b)
    assert sb["hits"] == 1 and sb["adopted_snapshots"] == 1
    assert sb["adopted_blocks"] == usage.reuse_tokens // 64  # every block of its path came from redis
    assert sb["fetched_bytes"] > 0 and sb["lookup_seconds"] < 2.0


def test_damaged_values_are_misses_and_the_output_stays_exact(model, redis_server, caplog):
    first = tokens(600, 3)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    ns = a.cache.shared.ns
    settle(a)
    r = _redis_values(redis_server)
    damaged = 0
    for key in r.scan_iter(f"{ns}:[bs]:*"):
        v = bytearray(r.get(key))
        v[len(v) // 2] ^= 0xFF  # one bit pattern in the middle of the payload
        r.set(key, bytes(v))
        damaged += 1
    assert damaged >= 10
    follow = first + out_a + tokens(80, 4)
    b = make(model, redis_server.url)
    with caplog.at_level(logging.WARNING, logger="hpc_cli.engine.shared"):
        out_b, usage = run(b, follow)
    sb = settle(b)
    assert usage.reuse_tokens == 0 and sb["hits"] == 0 and sb.get("values_damaged", 0) >= 1
    assert any("damaged value was not used" in m for m in caplog.messages)
    cold = make(model, None)
    assert run(cold, follow)[0] == out_b
    settle(cold)


def test_another_model_never_reads_these_entries(model, redis_server):
    from hpc_cli.model.model import HybridModel

    first = tokens(500, 5)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    settle(a)
    other = HybridModel.from_name_or_path("builtin:random@4", dtype=torch.float32)
    b = Engine(other, kv_pages=96, prefill_chunk=128, max_concurrency=2, host_cache_mib=16)
    tier = attach_shared_cache(b, redis_server.url)
    assert tier.ns != a.cache.shared.ns
    b.start()
    _, usage = run(b, first + out_a + tokens(80, 6))
    sb = settle(b)
    assert usage.reuse_tokens == 0 and sb["hits"] == 0 and not sb.get("values_stale")


def test_large_hits_are_read_by_the_lookup_thread_while_the_head_waits(model, redis_server, monkeypatch):
    first = tokens(520, 7)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    settle(a)
    monkeypatch.setattr(shared_find, "SYNC_FETCH_BYTES", 0)
    b = make(model, redis_server.url)
    follow = first + out_a + tokens(70, 8)
    out_b, usage = run(b, follow)
    sb = settle(b)
    assert usage.reuse_tokens > 500 and sb["lookups_async"] == 1 and sb["hits"] == 1
    cold = make(model, None)
    assert run(cold, follow)[0] == out_b
    settle(cold)


def test_an_unreachable_store_is_a_miss_with_one_warning(model, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"
    e = make(model, url, timeout_ms=300)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hpc_cli.engine.shared"):
        for i in range(3):
            _, usage = run(e, tokens(300, 20 + i))
            assert usage.reuse_tokens == 0
    assert time.monotonic() - t0 < 30
    st = settle(e)
    assert st["available"] is False and st["outages"] == 1 and st["last_error"]
    assert sum(1 for m in caplog.messages if "unavailable" in m) == 1
    assert st.get("writes_dropped_down", 0) + st.get("writes_failed", 0) >= 1


def test_entries_are_written_once_by_key(model, redis_server):
    _redis_values(redis_server).flushdb()
    p = tokens(400, 30)
    a = make(model, redis_server.url)
    run(a, p)
    a.cache.shared.flush()
    queued = a.stats().cache.shared.counts["writes_queued"]
    run(a, p)  # the same prompt again: nothing new to write
    ns = a.cache.shared.ns
    sa = settle(a)
    assert sa["writes_queued"] == queued and sa.get("writes_present", 0) == 0
    b = make(model, redis_server.url)
    run(b, p + [7] * 70)  # resumes from a's entries and writes only its own new ones
    sb = settle(b)
    assert sb["hits"] == 1 and sb.get("writes_present", 0) == 0  # never sent what a had stored
    r = _redis_values(redis_server)
    stored = sum(1 for _ in r.scan_iter(f"{ns}:[bs]:*"))
    assert stored == sa["writes_stored"] + sb["writes_stored"]


def test_a_slab_freed_before_the_writer_reads_it_is_never_stored(model, redis_server):
    """The writer thread copies a value out of its host slabs; a slab freed (and so possibly
    refilled by another owner) after the worker queued the value makes the value a drop, not a
    store of someone else's bytes."""
    e = make(model, redis_server.url)
    try:
        tier = e.cache.shared
        pool, host = e.cache.index.host, e.cache.host

        def probe():
            (slab,) = pool.alloc(1, SlabUse.NODE, owner="test")
            host.slab_view(slab).numpy()[:16] = 7
            read = SlabRead(slab, pool.generation(slab), 16, "payload")
            entry = BlockEntry(1, 0, 0, b"\0" * 256, ROOT_PATH, b"")
            w = Write(("k",), entry, 16, (read,))
            kept = tier._read(w)
            pool.free([slab])  # the slab changes hands: a later read of the queued value must drop it
            return kept, tier._read(w)

        kept, dropped = e.call(probe)
        assert kept is not None and bytes(kept.payload) == b"\x07" * 16
        assert dropped is None
    finally:
        e.stop()
    e.check_invariants()


def test_a_hit_is_copied_on_the_lookup_thread_not_the_worker(model, redis_server, monkeypatch):
    """The worker reserves host slabs for a hit and adopts it; the bytes are copied on the tier's
    lookup thread (the worker copies nothing), and the slabs reserved meanwhile keep the index's
    invariants."""
    copied_on = []
    real_copy = shared_mod.SharedTier._copy

    def copy(self, landing):
        copied_on.append(threading.current_thread().name)
        self.cache.index.check_invariants()  # reserved slabs (owner ADOPTING) are legal mid-copy
        return real_copy(self, landing)

    monkeypatch.setattr(shared_mod.SharedTier, "_copy", copy)
    first = tokens(640, 11)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    settle(a)
    b = make(model, redis_server.url)
    out_b, usage = run(b, first + out_a + tokens(70, 12))
    stats = settle(b)
    assert usage.reuse_tokens > 0 and stats["hits"] == 1, stats
    assert copied_on == ["hpc-shared-lookup"], copied_on
    host = b.cache.index.host
    assert not [s for s in range(host.num_slabs) if host.owner_of(s) == ADOPTING], "a reserved slab was left"


def test_a_copy_whose_lane_left_gives_its_slabs_back(model, redis_server):
    """A hit whose lane is no longer the head when its copy ends is not adopted: its reserved
    slabs go back to the host pool."""
    first = tokens(640, 13)
    a = make(model, redis_server.url)
    out_a, _ = run(a, first)
    settle(a)
    b = make(model, redis_server.url)
    tier = b.cache.shared
    hits = []
    real_land = shared_mod.SharedTier._land

    def land(self, landing):
        hits.append(landing)
        self._abandoned.append(landing)  # as if the lane had left: reaped, never adopted
        self._landing = None

    try:
        shared_mod.SharedTier._land = land
        run(b, first + out_a + tokens(70, 14))
    finally:
        shared_mod.SharedTier._land = real_land
    free_before = b.cache.index.host.free_slabs
    b.call(lambda: tier._reap(None))
    stats = settle(b)
    assert len(hits) == 1 and stats["hits"] == 0, stats
    assert b.cache.index.host.free_slabs == free_before + len(hits[0].slabs)


def test_a_prompt_with_an_image_resumes_from_the_shared_tier(redis_server, tmp_path):
    """Blocks that hold an image are keyed by its content (the media key is in the block key):
    an engine that never saw the prompt resumes it from what another wrote, past the image, with
    the cold engine's greedy output; the same tokens with another image find nothing usable."""
    from hpc_cli.engine.media import PromptImage
    from hpc_cli.model.image_processor import preprocess
    from hpc_cli.model.model import HybridModel
    from model.vision_checkpoint import make_image, write_vision_checkpoint
    from PIL import Image
    import io

    ck = write_vision_checkpoint(tmp_path / "vision")
    vm = HybridModel.from_name_or_path(str(ck.path), dtype=torch.float32, progress=False)
    mm = vm.multimodal

    def with_image(seed: int, text: list[int]) -> tuple[list[int], list[PromptImage]]:
        img = preprocess(Image.open(io.BytesIO(make_image(60, 44, seed))), vm.image_processor)
        toks = tokens(70, 21) + [mm.vision_start_token_id]
        n = vm.vision.tokens_of(img.grid)
        images = [PromptImage(img.pixels, img.grid, img.digest, len(toks), n)]
        return toks + [mm.image_token_id] * n + [mm.vision_end_token_id] + text, images

    def make_v(url):
        e = Engine(vm, kv_pages=64, prefill_chunk=64, max_concurrency=2, host_cache_mib=16)
        if url is not None:
            attach_shared_cache(e, url)
        return e.start()

    def gen(e, toks, images):
        req = GenerationRequest(list(toks), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                media=list(images))
        out, fin = e.generate(req, timeout=120)
        assert fin.reason == "length", (fin.reason, fin.error)
        return list(out), fin.usage

    toks, images = with_image(1, tokens(150, 22))
    a = make_v(redis_server.url)
    out_a, _ = gen(a, toks, images)
    settle(a)
    follow = toks + out_a + tokens(40, 23)
    b = make_v(redis_server.url)
    out_b, usage = gen(b, follow, images)
    stats = settle(b)
    cold = make_v(None)
    out_c, cold_usage = gen(cold, follow, images)
    settle(cold)
    assert stats["hits"] == 1 and usage.reuse_tokens > images[0].end, (stats, usage)
    assert cold_usage.reuse_tokens == 0 and out_b == out_c
    other, other_images = with_image(2, tokens(150, 22))  # the same tokens, another picture
    c = make_v(redis_server.url)
    _, usage_other = gen(c, other + out_a + tokens(40, 23), other_images)
    stats_other = settle(c)
    assert stats_other["hits"] == 0 and usage_other.reuse_tokens <= images[0].begin, (stats_other, usage_other)
