"""Replicas as real processes (`hpc-cli serve --shared-cache`) around a real redis-server: a KV
profile of its own never reads another's entries, and a Redis outage or restart is a run of
misses with a warning, never a failed request; the tier writes again once Redis is back."""

from __future__ import annotations

import time

import pytest

from .procs import Served, chat, conversation, next_turn
from .redis_proc import RedisProcess, free_port


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    redis = RedisProcess(tmp / "redis").start()
    a = b = None
    try:
        a = Served(tmp, "a", free_port(), "--shared-cache", redis.url)
        b = Served(tmp, "b", free_port(), "--shared-cache", redis.url, "--kv-profile", "int8-g64")
        a.wait_up(), b.wait_up()
        yield redis, a, b
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
        redis.stop()


def _dbsize(redis: RedisProcess) -> int:
    import redis as redis_py

    try:
        return int(redis_py.Redis.from_url(redis.url, socket_timeout=1).dbsize())
    except redis_py.RedisError:
        return -1


def test_another_kv_profile_never_reads_the_entries(replicas):
    redis, a, b = replicas
    msgs = conversation("profile")
    answer, _, _ = chat(a.url, msgs)
    follow = next_turn(msgs, answer, "And the mountains? ")
    deadline = time.monotonic() + 10
    while a.stats()["shared"].get("writes_stored", 0) == 0:  # a's entries are in redis
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _, prompt, cached = chat(b.url, follow)
    sa, sb = a.stats()["shared"], b.stats()["shared"]
    assert cached == 0 and sb["hits"] == 0 and prompt > 300
    assert sa["namespace"] != sb["namespace"]
    assert not sb.get("values_stale") and not sb.get("values_collision")  # not even read: other keys


def test_outage_and_restart_degrade_to_misses_with_a_warning(replicas):
    redis, a, _ = replicas
    port = redis.port
    redis.stop()
    for i in range(3):  # every request is served from the replica's own tiers
        msgs = conversation(f"outage {i}")
        answer, _, _ = chat(a.url, msgs)
        _, _, cached = chat(a.url, next_turn(msgs, answer, "Go on. "))
        assert cached > 0  # its own host/device tiers still serve the history
    assert "shared cache redis://127.0.0.1:%d/0 unavailable" % port in a.stderr()
    st = a.stats()["shared"]
    assert st["available"] is False and st["outages"] >= 1
    # Redis comes back empty on the same port; the replica retries within its backoff (<= 10 s)
    restarted = RedisProcess(redis.dir, port=port).start()
    redis.proc = restarted.proc
    deadline = time.monotonic() + 30
    i = 0
    while _dbsize(redis) <= 0:
        assert time.monotonic() < deadline, a.stderr()[-2000:]
        msgs = conversation(f"back {i}")
        chat(a.url, msgs)
        i += 1
        time.sleep(0.3)
    assert "is reachable again" in a.stderr()
    assert a.stats()["shared"]["available"] is True
