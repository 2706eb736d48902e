"""The built-in Redis store (hpc_plugins.shared_redis) against a real redis-server, and the
settings of the shared tier."""

from __future__ import annotations

import time

import pytest

from hpc_cli import plugins
from hpc_cli.errors import ConfigError
from hpc_cli.settings import load_settings
from hpc_cli.shared_store import SharedStoreUnavailable, StoreKey

from .redis_proc import free_port


def test_redis_store_is_a_registered_plugin():
    regs = plugins.registries()
    assert regs.shared_stores.names() == ["redis"]
    assert plugins.shared_store("rediss") is plugins.shared_store("unix") is plugins.shared_store("redis")
    info = {p["name"]: p for p in plugins.plugin_info()}
    assert info["hpc_plugins.shared_redis"]["registers"] == {"shared_stores": ["redis"]}


def test_put_once_get_and_sets(redis_server):
    store = plugins.shared_store("redis").open(redis_server.url, timeout_s=2.0)
    try:
        k1, k2, k3 = (StoreKey(f"test:{time.monotonic_ns()}:{i}") for i in range(3))
        assert store.put([(k1, b"one"), (k2, b"\0" * 100_000)]) == [True, True]
        assert store.put([(k1, b"other"), (k3, b"three")]) == [False, True]  # set once, by key
        assert store.get([k1, k2, k3, StoreKey("test:none")]) == [b"one", b"\0" * 100_000, b"three", None]
        s = StoreKey(f"test:set:{time.monotonic_ns()}")
        store.add_members(s, [b"64:ab", b"70:cd"])
        store.add_members(s, [b"64:ab"])
        assert store.members([s, StoreKey("test:noset")]) == [frozenset({b"64:ab", b"70:cd"}), frozenset()]
        store.remove_members(s, [b"70:cd"])
        assert store.members([s]) == [frozenset({b"64:ab"})]
        info = store.info()
        assert info.where == redis_server.url and info.keys >= 4 and info.used_bytes > 0
    finally:
        store.close()


def test_a_store_that_is_down_fails_fast_and_opening_needs_no_server():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = plugins.shared_store("redis").open(url, timeout_s=0.5)
    t0 = time.monotonic()
    for call in (lambda: store.get([StoreKey("k")]), lambda: store.put([(StoreKey("k"), b"v")]),
                 lambda: store.members([StoreKey("k")])):
        with pytest.raises(SharedStoreUnavailable) as exc:
            call()
        assert "127.0.0.1" in exc.value.message and exc.value.hint
    assert time.monotonic() - t0 < 3.0
    store.close()


def test_bad_urls_are_config_errors():
    kind = plugins.shared_store("redis")
    with pytest.raises(ConfigError):
        kind.open("redis://", timeout_s=1.0)
    with pytest.raises(ConfigError):
        kind.open("redis://127.0.0.1:6379/notadb", timeout_s=1.0)


def test_settings_of_the_shared_tier():
    r = load_settings(None, {"cache.shared_cache": "redis://u:secret@127.0.0.1:6379/0"}, environ={})
    assert r.settings.cache.shared_cache == "redis://u:secret@127.0.0.1:6379/0"
    assert r.effective["cache.shared_cache"] == "redis://u:***@127.0.0.1:6379/0"  # `config show` hides it
    assert r.settings.cache.shared_cache_timeout_ms == 2000
    with pytest.raises(ConfigError, match="host tier"):
        load_settings(None, {"cache.shared_cache": "redis://h/0", "cache.host_cache_mib": 0}, environ={})
    with pytest.raises(ConfigError, match="cache.mode"):
        load_settings(None, {"cache.shared_cache": "redis://h/0", "cache.mode": "off"}, environ={})
    with pytest.raises(ConfigError, match="memcache://") as exc:
        load_settings(None, {"cache.shared_cache": "memcache://h"}, environ={})
    assert "redis://" in exc.value.message
    r = load_settings(None, {}, environ={"HPC_CACHE__SHARED_CACHE": "unix:///run/redis.sock"})
    assert r.source("cache.shared_cache") == "env"
