"""The engine's stats document as the terminal view reads it: typed, parsed once
(:meth:`EngineStats.parse`).

The document is the JSON of the engine's :class:`~hpc_cli.engine.stats_types.EngineStats`
(``to_json(engine.stats())``, ``/v1/cache/stats``); this module only reads it and changes nothing in it. Every field an older
server or a cache mode of ``off`` lacks becomes 0, ``None`` or empty, and where a field has
more than one home (``settings.kv_profile`` or a top-level ``kv_profile``, ``free_slabs`` or
``slabs_by_use.free``, ...) the fallbacks are here and nowhere else. A section that is present
but not an object (``"cache": "not a dict"``) raises, as a document no server writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HOST_USES = ("free", "node", "image", "tail")


def _int(d: Any, *keys: str, default: int = 0) -> int:
    for k in keys:
        if not isinstance(d, dict):
            return default
        d = d.get(k)
    try:
        return int(d) if d is not None else default
    except (TypeError, ValueError):
        return default


def _float(x: Any) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The names the header shows: ``settings`` (what an in-process engine's settings add), else
    the document's top level."""

    kv_profile: str | None = None
    spec_backend: str | None = None
    cache_mode: str | None = None
    profile: str | None = None  # a profile's path or name


@dataclass(frozen=True, slots=True)
class RequestCounts:
    running: int = 0
    waiting: int = 0
    prefilling: int = 0


@dataclass(frozen=True, slots=True)
class Totals:
    """``counters``: since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    reuse_tokens: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The device page pool; ``pages`` the pool's size (the states' sum when not given)."""

    pages: int = 0
    free: int = 0
    active: int = 0
    cached: int = 0
    filling: int = 0
    page_bytes: int = 0


@dataclass(frozen=True, slots=True)
class HostStats:
    """The host tier's slabs by use (KV block bundles, snapshot images, tails); ``filling``:
    slabs in any other use."""

    slabs: int = 0
    slab_bytes: int = 0
    free: int = 0
    node: int = 0
    image: int = 0
    tail: int = 0
    filling: int = 0

    @property
    def enabled(self) -> bool:
        return self.slabs > 0


@dataclass(slots=True)
class SnapshotRow:
    """One row of ``cache.top_snapshots`` (the detailed stats' table)."""

    id: int
    frontier: int
    kind: str
    residency: str
    tail: str
    hits: int
    gdsf: float | None
    superseded: bool


@dataclass(frozen=True, slots=True)
class SnapshotStats:
    total: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_residency: dict[str, int] = field(default_factory=dict)
    slots: int = 0  # device snapshot slots held by the index
    slots_used: int = 0
    on_device: int = 0  # snapshots whose image is in a device slot (residency device or both)
    image_bytes: int = 0
    rows: list[SnapshotRow] | None = None  # None: the document carries no per-snapshot rows


@dataclass(slots=True)
class TransferStats:
    restores_inflight: int = 0
    writes_inflight: int = 0
    restore_bytes_inflight: int | None = None
    write_bytes_inflight: int | None = None
    pending_jobs: int = 0
    failures: int = 0
    restores_total: int = 0
    restored_bytes_total: int = 0
    writes_landed_total: int = 0
    written_bytes_total: int | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    pool: PoolStats
    host: HostStats
    snapshots: SnapshotStats
    transfers: TransferStats
    nodes_total: int = 0
    gdsf_L: float = 0.0
    snapshot_hits: int = 0


@dataclass(frozen=True, slots=True)
class SpecStats:
    backend: str = "-"  # the section's, else the settings' name
    k: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


@dataclass(frozen=True, slots=True)
class ExpertStats:
    offload: bool = False
    admission: str = "-"
    slots: int = 0
    resident: int = 0
    expert_bytes: int = 0
    hit_rate: float | None = None
    tokens: int = 0
    host_bytes: int = 0
    host_bytes_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One stats document. ``cache`` None: no prefix cache (an empty or absent ``cache``)."""

    model: str | None = None
    settings: RunSettings = RunSettings()
    uptime_s: float = 0.0
    max_concurrency: int = 0
    requests: RequestCounts = RequestCounts()
    fatal: str | None = None
    cache: CacheStats | None = None
    counters: Totals = Totals()
    ttft_recent_s: tuple[float, ...] = ()
    speculative: SpecStats | None = None  # None: no drafting backend
    experts: ExpertStats | None = None  # None: no MoE expert tier

    @classmethod
    def parse(cls, stats: dict) -> "EngineStats":
        meta = stats.get("settings") or {}
        if not isinstance(meta, dict):
            meta = {}
        spec = stats.get("speculative") if isinstance(stats.get("speculative"), dict) else None
        settings = RunSettings(
            kv_profile=stats.get("kv_profile") or meta.get("kv_profile"),
            spec_backend=(meta.get("speculative_backend") or meta.get("spec_backend")
                          or (spec or {}).get("backend") or stats.get("spec_backend")),
            cache_mode=meta.get("cache_mode") or stats.get("cache_mode"),
            profile=meta.get("profile_path") or meta.get("profile") or stats.get("profile"))
        req = stats.get("requests") or {}
        c = stats.get("counters") or {}
        cache = stats.get("cache") or {}
        ex = stats.get("experts")
        return cls(
            model=stats.get("model"), settings=settings, uptime_s=float(stats.get("uptime_s") or 0.0),
            max_concurrency=_int(stats, "max_concurrency"),
            requests=RequestCounts(_int(req, "running"), _int(req, "waiting"), _int(req, "prefilling")),
            fatal=stats.get("fatal"), cache=parse_cache(cache) if cache else None,
            counters=Totals(requests=_int(c, "requests"), prompt_tokens=_int(c, "prompt_tokens"),
                            reuse_tokens=_int(c, "reuse_tokens"), prefill_tokens=_int(c, "prefill_tokens")),
            ttft_recent_s=tuple(float(x) for x in (stats.get("ttft_recent_s") or [])),
            speculative=None if spec is None else SpecStats(
                backend=str(spec.get("backend") or settings.spec_backend or "-"), k=_int(spec, "k"), rounds=_int(spec, "rounds"),
                draft_tokens=_int(spec, "draft_tokens"), accepted_draft_tokens=_int(spec, "accepted_draft_tokens"),
                acceptance_rate=_float(spec.get("acceptance_rate")),
                mean_acceptance_length=_float(spec.get("mean_acceptance_length"))),
            experts=None if not isinstance(ex, dict) else ExpertStats(
                offload=bool(ex.get("offload")), admission=str(ex.get("admission") or "-"), slots=_int(ex, "slots"),
                resident=_int(ex, "resident"), expert_bytes=_int(ex, "expert_bytes"),
                hit_rate=_float(ex.get("hit_rate")), tokens=_int(ex, "tokens"), host_bytes=_int(ex, "host_bytes"),
                host_bytes_per_token=_float(ex.get("host_bytes_per_token"))))


def parse_cache(cache: dict) -> CacheStats:
    """The ``cache`` section (``{}``: every number 0, no rows)."""
    idx = cache.get("index") or {}
    pc = cache.get("pool") or {}
    pool = PoolStats(pages=_int(cache, "pages") or sum(_int(pc, k) for k in ("free", "active", "cached", "filling")),
                     free=_int(pc, "free"), active=_int(pc, "active"), cached=_int(pc, "cached"),
                     filling=_int(pc, "filling"), page_bytes=_int(cache, "page_bytes"))

    host = idx.get("host") or {}
    use = host.get("slabs_by_use") or {}
    host_stats = HostStats(slabs=_int(host, "slabs") or _int(cache, "host_slabs"),
                           slab_bytes=_int(host, "slab_bytes") or _int(cache, "slab_bytes"),
                           free=_int(host, "free_slabs") if "free_slabs" in host else _int(use, "free"),
                           node=_int(use, "node"), image=_int(use, "image"), tail=_int(use, "tail"),
                           filling=sum(_int(use, k) for k in use if k not in HOST_USES))

    dev = idx.get("device") or {}
    snaps = idx.get("snapshots") or {}
    rows = cache.get("top_snapshots")
    by_res = snaps.get("by_residency") or {}
    snapshots = SnapshotStats(
        total=_int(snaps, "total"), by_kind=dict(snaps.get("by_kind") or {}), by_residency=dict(by_res),
        slots=_int(dev, "snapshot_slots"), slots_used=_int(dev, "snapshot_slots_used"),
        on_device=_int(by_res, "device") + _int(by_res, "both"), image_bytes=_int(cache, "image_bytes"),
        rows=[SnapshotRow(id=_int(r, "id"), frontier=_int(r, "frontier"), kind=str(r.get("kind", "?")),
                          residency=str(r.get("residency", "?")), tail=str(r.get("tail", "-")), hits=_int(r, "hits"),
                          gdsf=r.get("gdsf"), superseded=bool(r.get("superseded")))
              for r in rows if isinstance(r, dict)] if isinstance(rows, list) else None)

    ic = idx.get("counters") or {}
    tr = idx.get("transfers") or {}
    inflight = cache.get("inflight") or {}
    transfers = TransferStats(
        restores_inflight=_int(tr, "restores"), writes_inflight=_int(tr, "writes"),
        restore_bytes_inflight=inflight.get("restore_bytes"), write_bytes_inflight=inflight.get("write_bytes"),
        pending_jobs=_int(cache, "transfers_pending"), failures=_int(cache, "transfer_failures"),
        restores_total=_int(ic, "restores"),
        restored_bytes_total=_int(ic, "restored_bytes") or _int(cache, "restored_host_bytes"),
        writes_landed_total=_int(ic, "writes_landed"),
        written_bytes_total=ic.get("written_bytes") if "written_bytes" in ic else None)
    return CacheStats(pool=pool, host=host_stats, snapshots=snapshots, transfers=transfers,
                      nodes_total=_int(idx, "nodes", "total"), gdsf_L=float(idx.get("gdsf_L") or 0.0),
                      snapshot_hits=_int(ic, "snapshot_hits"))
