"""The engine's stats as types: what ``Engine.stats()`` publishes and ``Engine.detailed_stats()``
makes fresh, from the engine's own figures down to its cache binding's and its shared tier's.

They travel as these dataclasses inside the process; JSON is made from them at the HTTP edge
only (:func:`to_json`: ``/v1/cache/stats``, ``/metrics``, and ``hpc-cli top`` reading an engine
in its own process), with the keys clients read. ``hpc-cli top`` parses that JSON back into its
own view types (:mod:`hpc_cli.tui.stats`), which also read older servers' documents.

The sections come from the code that makes them: the index's counts
(:class:`~hpc_cli.cache.stats.IndexStats`), the checkpoint catalog's
(:class:`~hpc_cli.cache.catalog.CatalogStats`), the page pool's
(:class:`~hpc_cli.memory.pools.PoolCounts`), the kernel compilations
(:class:`~hpc_cli.model.compile_watch.CompileStats`), the expert tier's
(:class:`~hpc_cli.experts.tier.ExpertTierStats`) and the speculative runtime's
(:class:`~hpc_cli.speculative.runtime.SpeculativeStats`).

Two field markers shape the JSON (defined in :mod:`hpc_cli.cache.stats`, the lowest layer with
stats types): :data:`FLAT` (a mapping whose keys join its parent's, as a binding's running
counters do) and :data:`OPTIONAL` (left out while None: a section a cache mode or an engine does
not have). A dataclass with an ``as_dict()`` of its own (the host tier's
:class:`~hpc_cli.memory.host_slabs.PinProgress`) is written by it."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from hpc_cli.cache.stats import FLAT, OPTIONAL

if TYPE_CHECKING:  # the sections' types, for annotations only (this module stays light: ``hpc-cli top`` reads it)
    from hpc_cli.cache.catalog import CatalogStats
    from hpc_cli.cache.stats import IndexStats, InflightBytes
    from hpc_cli.experts.tier import ExpertTierStats
    from hpc_cli.memory.host_slabs import PinProgress
    from hpc_cli.memory.pools import PoolCounts
    from hpc_cli.model.compile_watch import CompileStats
    from hpc_cli.speculative.runtime import SpeculativeStats


#: a JSON value as :func:`to_json` writes it
JSON = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
#: one row of the snapshot table (``cache.top_snapshots``: id, frontier, kind, residency, ...)
SnapshotRow = dict[str, JSON]


def to_json(value: object) -> JSON:
    """``value`` as JSON: dataclasses by their fields (see the module doc), enums by value,
    mappings and sequences item by item."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        as_dict = getattr(value, "as_dict", None)
        if as_dict is not None:
            return to_json(as_dict())
        out: dict[str, JSON] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is None and f.metadata.get("optional"):
                continue
            if f.metadata.get("flat"):
                out.update({str(k): to_json(x) for k, x in v.items()})
            else:
                out[f.name] = to_json(v)
        return out
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value  # type: ignore[return-value]  # a JSON scalar


@dataclass(frozen=True, slots=True)
class Residency:
    """What a cache holds right now, in bytes, and how many reusable entries (snapshots,
    checkpoints): the same figures for every mode (``hpc-cli bench`` plots them)."""

    device_kv_bytes: int = 0
    device_state_bytes: int = 0
    host_bytes: int = 0
    entries: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"device_kv_bytes": self.device_kv_bytes, "device_state_bytes": self.device_state_bytes,
                "host_bytes": self.host_bytes, "entries": self.entries}


@dataclass(slots=True, kw_only=True)
class SharedTierStats:
    """The shared tier's (L3) figures (:meth:`hpc_cli.engine.shared.SharedTier.stats`)."""

    where: str
    namespace: str
    available: bool
    outages: int
    last_error: str | None
    timeout_s: float
    queued_bytes: int
    lookups: int
    hits: int
    misses: dict[str, int]  # by reason, only those seen ("timeout", "block_<why>", ...): open-ended
    lookup_seconds: float
    counts: dict[str, int] = field(default_factory=dict, metadata=FLAT)  # writes_*, hit_tokens, ...


@dataclass(slots=True, kw_only=True)
class CacheStats:
    """What every cache binding reports (``CacheBinding.stats``): its device pool, lanes, host
    slabs, the bytes of a page and of a state image, its residency and running counters; with
    ``detailed``, the snapshot table. ``mode`` is named by the modes other than hybrid."""

    mode: str | None = field(default=None, metadata=OPTIONAL)
    pool: PoolCounts
    pages: int
    lanes_free: int
    host_slabs: int
    slab_bytes: int
    page_bytes: int
    image_bytes: int
    transfers_pending: int
    #: the binding's events since start; each cache mode (a plugin's included) names its own, so a mapping
    counters: dict[str, int] = field(default_factory=dict, metadata=FLAT)
    residency: Residency
    top_snapshots: list[SnapshotRow] | None = field(default=None, metadata=OPTIONAL)


@dataclass(slots=True, kw_only=True)
class HybridCacheStats(CacheStats):
    """The hybrid binding's: the index's own document (:mod:`hpc_cli.cache.stats`), its
    snapshot slots, the host tier's pinning, the copies in flight and the shared tier."""

    index: IndexStats
    snapshot_slots: int
    host_tier: "PinProgress"
    inflight: InflightBytes
    shared: SharedTierStats | None = field(default=None, metadata=OPTIONAL)


@dataclass(slots=True, kw_only=True)
class LegacyCacheStats(CacheStats):
    """Cache mode legacy's: the checkpoint catalog's counts and the state slots and host slabs
    it uses."""

    catalog: CatalogStats
    device_state_slots: int
    device_state_slots_used: int
    host_kv_slabs: int
    host_kv_slabs_used: int
    host_state_slots: int
    host_state_slots_used: int
    host_tier: "PinProgress"


@dataclass(frozen=True, slots=True)
class RequestCounts:
    running: int
    waiting: int
    prefilling: int


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The names a client shows next to the stats (``hpc-cli top``'s header)."""

    kv_profile: str
    speculative_backend: str
    cache_mode: str
    profile_path: str | None


@dataclass(slots=True, kw_only=True)
class EngineStats:
    """The engine's stats (``Engine.stats()``, ``Engine.detailed_stats()``)."""

    model: str
    kv_profile: str
    max_concurrency: int
    prefill_chunk: int
    uptime_s: float
    requests: RequestCounts
    counters: dict[str, int]  # since start: requests, tokens, finished_<reason>, ...: a key per finish reason seen
    cache: CacheStats
    ttft_recent_s: list[float]
    fatal: str | None
    compilations: int  # Triton compilations and autotune runs after the warm-up
    kernel_compilations: CompileStats
    experts: ExpertTierStats | None = field(default=None, metadata=OPTIONAL)  # the expert tier's
    speculative: SpeculativeStats | None = field(default=None, metadata=OPTIONAL)  # the speculative runtime's
    settings: RunSettings

    def to_json(self) -> dict[str, JSON]:
        doc = to_json(self)
        assert isinstance(doc, dict), "an EngineStats is written as an object"
        return doc
