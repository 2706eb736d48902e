"""One engine's shared tier (L3): the object the binding and the engine hold, its threads, its
stats and its close; :func:`attach_shared_cache` connects an engine (docs/shared-cache.md). The
lookups are :mod:`.lookup` and :mod:`.find`, the write-behind :mod:`.writer`."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hpc_cli import plugins
from hpc_cli.cache import shared as rec
from hpc_cli.cache.shared import Namespace, PathDigest, StoreKey
from hpc_cli.cache.tree import BlockNode
from hpc_cli.engine.shared.find import StoreSearch
from hpc_cli.engine.shared.health import Health
from hpc_cli.engine.shared.lookup import Landing, Lookup, Lookups
from hpc_cli.engine.shared.writer import Write, Writes
from hpc_cli.engine.stats_types import SharedTierStats
from hpc_cli.errors import ConfigError
from hpc_cli.shared_store import SharedStore

if TYPE_CHECKING:
    from hpc_cli.engine.engine import Engine
    from hpc_cli.engine.hybrid import HybridBinding
    from hpc_cli.engine.lane import Lane

log = logging.getLogger("hpc_cli.engine.shared")

#: the worker's own store calls give up after at most this long (the lookup thread's after timeout_s)
SYNC_TIMEOUT_S = 0.25


@dataclass(frozen=True, slots=True)
class SharedTierConfig:
    url: str
    timeout_s: float = 2.0  # each store call's limit, and how long an admission waits for its lookup
    queue_bytes: int = 256 << 20  # entries copied out and not yet stored


class SharedTier(Lookups, StoreSearch, Writes):
    """One engine's view of the shared store (see the module doc). The worker calls
    :meth:`before_admit`, :meth:`start_lookup`, :meth:`written` and :meth:`stats`; the rest runs on
    the tier's two threads."""

    def __init__(self, cache: "HybridBinding", store: SharedStore, ns: Namespace, config: SharedTierConfig,
                 where: str, wake: Callable[[], None] = lambda: None, probe_store: SharedStore | None = None) -> None:
        self.cache = cache
        self.store = store  # the writer's and the lookup thread's
        self.probe_store = probe_store or store  # the worker's (a shorter timeout)
        self.ns = ns
        self.config = config
        self.where = where
        self.wake = wake
        self.health = Health(where)
        index = cache.index
        self.block_bytes = index.block_bytes
        self.image_bytes = index.image_bytes
        self.slab_bytes = cache.host.slab_bytes
        self.image_slabs = index.image_slabs
        self._lookup: Lookup | None = None
        self._landing: Landing | None = None  # the head's hit being copied in
        self._abandoned: list[Landing] = []  # copies of lanes that left: slabs given back once done
        self._looked_up: "Lane | None" = None  # the lane whose lookup ended (adopted or missed)
        self._digests: dict[BlockNode, PathDigest] = {}
        self._seen: collections.OrderedDict[StoreKey, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.misses: collections.Counter[str] = collections.Counter()
        self.lookup_seconds = 0.0
        self._queued_bytes = 0
        self._writes: "queue.Queue[Write | None]" = queue.Queue()
        self._jobs: "queue.Queue[Lookup | Landing | None]" = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="hpc-shared-writer", daemon=True)
        self._fetcher = threading.Thread(target=self._lookup_loop, name="hpc-shared-lookup", daemon=True)
        self._writer.start()
        self._fetcher.start()

    def describe(self) -> str:
        return f"shared cache tier {self.where} (namespace {self.ns})"

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def stats(self) -> SharedTierStats:
        with self._lock:
            counts = dict(self.counts)
            queued = self._queued_bytes
        return SharedTierStats(where=self.where, namespace=self.ns, available=not self.health.down,
                               outages=self.health.outages, last_error=self.health.last_error,
                               timeout_s=self.config.timeout_s, queued_bytes=queued,
                               lookups=counts.pop("lookups", 0), hits=counts.pop("hits", 0),
                               misses=dict(self.misses), lookup_seconds=round(self.lookup_seconds, 6), counts=counts)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued entry was stored (or dropped); True when the queue emptied."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued_bytes == 0 and self._writes.empty():
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 2.0) -> None:
        """Store what is queued (for at most ``timeout`` seconds), stop the threads, close the store."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        self._writes.put(None)
        self._jobs.put(None)
        self._writer.join(timeout)
        self._fetcher.join(timeout)
        if not self._fetcher.is_alive():  # no copy in flight: reserved slabs go back to the pool
            for landing in [*self._abandoned, *([self._landing] if self._landing is not None else [])]:
                self.cache.index.release_host_slabs(landing.slabs)
            self._abandoned, self._landing = [], None
        self.store.close()
        if self.probe_store is not self.store:
            self.probe_store.close()

def open_store(url: str, timeout_s: float) -> tuple[SharedStore, str]:
    """The store for ``url`` through the plugin that serves its scheme, and where it is (no
    credentials)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if not u.scheme:
        raise ConfigError(f"cache.shared_cache {url!r} is not a URL",
                          hint="write redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0")
    kind = plugins.shared_store(u.scheme)
    host = u.hostname or ""
    where = f"{u.scheme}://{host}{':' + str(u.port) if u.port else ''}{u.path or ''}"
    return kind.open(url, timeout_s=timeout_s), where


def attach_shared_cache(engine: "Engine", url: str, *, timeout_ms: int = 2000, queue_mib: int = 256) -> SharedTier:
    """Connect ``engine`` to the shared tier at ``url`` (before ``engine.start()``): its namespace
    is the engine's fingerprint and host geometry (spec §5.5). The store need not be up."""
    from hpc_cli.engine.persistence import engine_fingerprint, engine_geometry

    from hpc_cli.engine.hybrid import HybridBinding

    cache = engine.cache
    if not isinstance(cache, HybridBinding) or not cache.reuse:
        raise ConfigError("cache.shared_cache needs cache.mode = 'hybrid' (its blocks and snapshots are what "
                          "replicas share)", hint="set cache.mode = 'hybrid', or leave cache.shared_cache unset")
    if cache.host.num_slabs == 0:
        raise ConfigError("cache.shared_cache needs the host tier (hits restore through it)",
                          hint="set cache.host_cache_mib above 0")
    if cache.shared is not None:
        raise ConfigError("a shared cache tier is already attached", hint="attach one shared cache per engine")
    cfg = SharedTierConfig(url, timeout_ms / 1000.0, queue_mib << 20)
    store, where = open_store(url, cfg.timeout_s)
    ns = rec.namespace(engine_fingerprint(engine), engine_geometry(engine).as_dict())
    probe, _ = open_store(url, min(cfg.timeout_s, SYNC_TIMEOUT_S))
    tier = SharedTier(cache, store, ns, cfg, where, wake=engine._wake.set, probe_store=probe)
    cache.shared = tier
    engine.on_stop.append(lambda _engine: tier.close())
    engine.on_fatal.append(lambda _engine: tier.close(timeout=0.5))
    return tier

