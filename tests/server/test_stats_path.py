"""The stepping path never walks the cache (issue 17 item 3): the worker publishes running counts,
a full walk happens only when a client asks (/v1/cache/stats, ``hpc-cli top``) and then on the
worker; an idle worker sleeps instead of polling; the host tier joins as its chunks are ready."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from hpc_cli.cache import stats as cache_stats
from hpc_cli.cache.host import HostSlabPool
from hpc_cli.cache.tree import BlockTree
from hpc_cli.engine.hybrid import binding as hybrid
from hpc_cli.engine.api import GenerationRequest, SamplingParams, to_json
from hpc_cli.engine.engine import Engine
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.server.app import create_app
from hpc_cli.settings import load_settings

FLAGS = {"model.name": "builtin:random", "model.device": "cpu", "model.max_model_len": 2048,
         "engine.max_concurrency": 2, "engine.prefill_chunk": 128, "cache.host_cache_mib": 64}
SYSTEM = [10 + i % 240 for i in range(200)]  # a shared prefix: blocks, taps, write-through


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _ask(engine: Engine, tail: list[int]):
    _, fin = engine.generate(GenerationRequest(SYSTEM + tail, _greedy()), timeout=120)
    assert fin.reason == "length", (fin.reason, fin.error)
    return fin


@pytest.fixture
def walks(monkeypatch):
    """Every walk of the cache, by name, with the thread that made it."""
    seen: list[tuple[str, str]] = []

    def counting(name, fn):
        def wrapper(*a, **k):
            seen.append((name, threading.current_thread().name))
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(BlockTree, "walk", counting("tree", BlockTree.walk))
    monkeypatch.setattr(cache_stats, "recount", counting("recount", cache_stats.recount))
    monkeypatch.setattr(cache_stats, "stats", counting("stats", cache_stats.stats))
    monkeypatch.setattr(cache_stats, "inflight_bytes", counting("inflight", cache_stats.inflight_bytes))
    monkeypatch.setattr(hybrid, "snapshot_rows", counting("rows", hybrid.snapshot_rows))
    monkeypatch.setattr(HostSlabPool, "use_of", counting("slab", HostSlabPool.use_of))
    monkeypatch.setattr(HostSlabPool, "recount_by_use", counting("slabs", HostSlabPool.recount_by_use))
    return seen


def test_no_walk_until_a_client_asks_and_then_on_the_worker(walks, serve):
    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    url = serve(create_app(engine, settings))
    try:
        for k in range(3):
            _ask(engine, [250 + k] * 40)
        time.sleep(0.3)
        st = engine.stats().to_json()  # the published stats (and /metrics) are running counts
        host = st["cache"]["index"]["host"]
        assert st["counters"]["requests"] == 3 and st["cache"]["index"]["snapshots"]["total"] >= 1
        assert host["slabs_by_use"]["node"] >= 3 and st["cache"]["host_tier"]["state"] == "ready"
        assert "top_snapshots" not in st["cache"] and "inflight" in st["cache"]
        assert "hpc_engine_cache_index_nodes_total" in httpx.get(url + "/metrics", timeout=10).text
        assert walks == [], walks

        served = httpx.get(url + "/v1/cache/stats", timeout=10).json()
        rows = served["cache"]["top_snapshots"]
        assert rows and {r["id"] for r in rows} <= set(engine.cache.index.snapshots)
        assert walks == [("rows", "hpc-engine")], walks  # made by the worker, between two steps
        assert served["cache"]["index"] == to_json(engine.cache.index.stats(recount=True))
    finally:
        engine.stop()
    engine.check_invariants()


def test_idle_worker_sleeps_until_woken(monkeypatch):
    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings)
    rounds = []
    step = engine._step
    monkeypatch.setattr(engine, "_step", lambda: rounds.append(1) or step())
    engine.start()
    try:
        _ask(engine, [7] * 20)
        time.sleep(0.2)
        before = len(rounds)
        time.sleep(0.5)
        assert len(rounds) == before, "the idle worker polled"
        assert engine.detailed_stats(timeout=5).cache.top_snapshots is not None  # a stats request wakes it
        _ask(engine, [8] * 20)  # so does a submit
        assert len(rounds) > before + 1
    finally:
        engine.stop()
    assert not engine._thread.is_alive()


def test_engine_serves_while_the_host_tier_pins_then_uses_it(monkeypatch):
    """The host tier's chunk is allocated in the background: requests are served before it is
    ready (without host copies), and it joins the index once ready."""
    gate = threading.Event()
    real = HostSlabStorage._alloc_chunk

    def slow(self, nbytes):
        assert gate.wait(30), "never released"
        return real(self, nbytes)

    monkeypatch.setattr(HostSlabStorage, "_alloc_chunk", slow)
    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    try:
        fin = _ask(engine, [5] * 30)
        st = engine.detailed_stats(timeout=5).to_json()
        host = st["cache"]["index"]["host"]
        assert fin.usage.completion_tokens == 6 and host["ready_slabs"] == 0 and host["slabs"] > 0
        assert st["cache"]["host_tier"]["state"] == "pinning" and st["cache"]["host_tier"]["ready_bytes"] == 0
        assert st["cache"]["index"]["counters"]["block_writes_refused"] >= 1
        gate.set()  # the chunk is ready: the worker is woken and hands its slabs to the index
        deadline = time.monotonic() + 10
        while engine.stats().cache.index.host.ready_slabs == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats().cache.host_tier.state == "ready"
        _ask(engine, [6] * 30)
        assert engine.detailed_stats(timeout=5).cache.index.host.slabs_by_use.get("node", 0) >= 3
    finally:
        gate.set()
        engine.stop()
    engine.check_invariants()
