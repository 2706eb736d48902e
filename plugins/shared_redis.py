"""Built-in shared cache store: Redis (or Valkey) through redis-py.

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
``unix:///path/to/redis.sock[?db=N]``. Values are plain strings (``SET key value NX``), the
snapshot index is sets (``SADD`` / ``SMEMBERS``); batches go through one pipeline, so a lookup
is one round trip for the index and one for the values. Every call gives up after the tier's
timeout and never retries on its own: the tier decides when to try again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence
from urllib.parse import urlsplit

import hpc_cli
from hpc_cli.errors import ConfigError
from hpc_cli.shared_store import SharedStore, SharedStoreKind, SharedStoreUnavailable, StoreInfo, StoreKey

if TYPE_CHECKING:
    import redis


def _where(url: str) -> str:
    """The URL without credentials (for logs and stats)."""
    u = urlsplit(url)
    host = u.hostname or ""
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://{host}{port}{u.path or ''}"


class RedisStore(SharedStore):
    def __init__(self, client: "redis.Redis", where: str) -> None:
        import redis

        self._client = client
        self._where = where
        self._redis_error = redis.RedisError  # connection, timeout, loading, out of memory: all a miss

    def _fail(self, what: str, exc: Exception) -> SharedStoreUnavailable:
        return SharedStoreUnavailable(f"shared cache {self._where}: {what} failed: {exc}",
                                      hint="check that the Redis server runs and is reachable")

    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            return list(self._client.mget(list(keys)))
        except self._redis_error as exc:
            raise self._fail("get", exc) from None

    def put(self, items: Sequence[tuple[StoreKey, bytes]]) -> list[bool]:
        if not items:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, nx=True)
            return [bool(r) for r in pipe.execute()]
        except self._redis_error as exc:
            raise self._fail("put", exc) from None

    def add_members(self, key: StoreKey, members: Sequence[bytes]) -> None:
        if not members:
            return
        try:
            self._client.sadd(key, *members)
        except self._redis_error as exc:
            raise self._fail("add", exc) from None

    def members(self, keys: Sequence[StoreKey]) -> list[frozenset[bytes]]:
        if not keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(key)
            return [frozenset(m or ()) for m in pipe.execute()]
        except self._redis_error as exc:
            raise self._fail("members", exc) from None

    def remove_members(self, key: StoreKey, members: Sequence[bytes]) -> None:
        if not members:
            return
        try:
            self._client.srem(key, *members)
        except self._redis_error as exc:
            raise self._fail("remove", exc) from None

    def info(self) -> StoreInfo:
        try:
            mem = self._client.info("memory")
            keys = self._client.dbsize()
        except self._redis_error:
            return StoreInfo(self._where)
        return StoreInfo(self._where, used_bytes=int(mem.get("used_memory", 0)), keys=int(keys))

    def close(self) -> None:
        try:
            self._client.close()
        except self._redis_error:  # pragma: no cover - closing a broken connection
            pass


class RedisStoreKind(SharedStoreKind):
    name = "redis"
    aliases = ("rediss", "unix")
    description = "Redis or Valkey (redis-py): SET NX values, SADD/SMEMBERS snapshot index, pipelined"

    def open(self, url: str, *, timeout_s: float) -> SharedStore:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        u = urlsplit(url)
        if u.scheme not in (self.name, *self.aliases):
            raise ConfigError(f"shared cache URL {_where(url)}: not a Redis URL",
                              hint="write redis://HOST:PORT/DB, rediss://... or unix:///path/redis.sock")
        if u.scheme != "unix" and not u.hostname:
            raise ConfigError(f"shared cache URL {_where(url)} names no host",
                              hint="write redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0")
        if u.scheme != "unix" and u.path.strip("/") and not u.path.strip("/").isdigit():
            raise ConfigError(f"shared cache URL {_where(url)}: the database {u.path.strip('/')!r} is not a number",
                              hint="write redis://HOST:PORT/DB with DB a number, e.g. redis://127.0.0.1:6379/0")
        try:
            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                          health_check_interval=0, client_name="hpc-cli")
        except ValueError as exc:
            raise ConfigError(f"shared cache URL {_where(url)}: {exc}",
                              hint="write redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0") from None
        return RedisStore(client, _where(url))


@hpc_cli.hookimpl
def hpc_register_shared_stores(register):
    register(RedisStoreKind())
