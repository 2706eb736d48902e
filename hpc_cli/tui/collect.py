"""Pure data for the terminal view: the engine's stats document (in process, or
``/v1/cache/stats`` over HTTP), parsed once into :class:`hpc_cli.tui.stats.EngineStats`, into a
typed :class:`View`, with a rolling one-minute history for rates and sparklines.

Nothing here touches the terminal. Every field the stats may lack (an older server, a cache mode
of ``off``) becomes ``None`` or an empty list, and the renderer shows a dash.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from hpc_cli.engine.api import to_json
from hpc_cli.tui.stats import (EngineStats, ExpertStats, HostStats, PoolStats, SnapshotRow, SpecStats, TransferStats,
                               parse_cache)

HISTORY_S = 60.0
NO_CACHE = parse_cache({})  # a server without a prefix cache: every number 0


class SourceGone(Exception):
    """The stats source is not there (or went away): one line, for the user."""


# ---------------------------------------------------------------------------------------------
# The view model
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Transfers(TransferStats):
    """The document's transfer numbers and the rates :class:`Collector` computes from the last
    few seconds of documents."""

    restore_gbps: float | None = None
    write_gbps: float | None = None
    restores_per_s: float | None = None
    writes_per_s: float | None = None


@dataclass(slots=True)
class SnapshotSlots:
    slots: int = 0  # device snapshot slots held by the index
    active: int = 0  # lane slots (one per running request)
    lanes: int = 0
    snapshot: int = 0  # slots holding a retained snapshot image
    staging: int = 0
    superseded: int = 0
    image_bytes: int = 0


@dataclass(slots=True)
class Reuse:
    requests: int = 0
    prompt_tokens: int = 0
    reuse_tokens: int = 0
    prefill_tokens: int = 0
    saved_tokens: int = 0  # prompt tokens not prefilled
    hit_rate: float | None = None  # reuse tokens / prompt tokens, since start
    snapshot_hits: int = 0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    ttft_n: int = 0


@dataclass(slots=True)
class View:
    source: str = ""
    model: str = "-"
    kv_profile: str = "-"
    spec_backend: str | None = None
    cache_mode: str | None = None
    profile: str | None = None
    uptime_s: float = 0.0
    max_concurrency: int = 0
    running: int = 0
    waiting: int = 0
    prefilling: int = 0
    fatal: str | None = None
    cache_on: bool = True
    pool: PoolStats = field(default_factory=PoolStats)
    slots: SnapshotSlots = field(default_factory=SnapshotSlots)
    host: HostStats = field(default_factory=HostStats)
    snapshots_total: int = 0
    snapshots_by_kind: dict[str, int] = field(default_factory=dict)
    snapshots_by_residency: dict[str, int] = field(default_factory=dict)
    snapshot_rows: list[SnapshotRow] | None = None  # None: the stats carry no per-snapshot rows
    nodes_total: int = 0
    gdsf_L: float = 0.0
    transfers: Transfers = field(default_factory=Transfers)
    reuse: Reuse = field(default_factory=Reuse)
    speculative: SpecStats | None = None  # None: no drafting backend (the default view)
    experts: ExpertStats | None = None  # None: no MoE expert tier
    # one-minute series (oldest first), one point per sample
    spark_hit_rate: list[float] = field(default_factory=list)
    spark_reuse_tps: list[float] = field(default_factory=list)
    spark_ttft: list[float] = field(default_factory=list)
    spark_restore_gbps: list[float] = field(default_factory=list)
    spark_running: list[float] = field(default_factory=list)
    spark_waiting: list[float] = field(default_factory=list)
    empty: bool = False  # the source answered with no stats yet
    # what the live loop adds (not from the stats): the server's address line, the keys, a notice
    banner: list[str] = field(default_factory=list)
    keys: str | None = None
    notice: str | None = None


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _stem(path: Any) -> str:
    """A profile's name from its path (``/etc/hpc/h200.toml`` -> ``h200``)."""
    name = str(path).replace("\\", "/").rsplit("/", 1)[-1]
    return name[:-5] if name.endswith(".toml") else name


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------
# Stats dict -> View (one frame, no history)
# ---------------------------------------------------------------------------------------------
def build_view(stats: dict | EngineStats, source: str = "") -> View:
    """One frame from one stats document (parsed here when it is a dict); rates and sparklines
    come from :class:`Collector`."""
    v = View(source=source)
    if not stats:
        v.empty = True
        return v
    s = stats if isinstance(stats, EngineStats) else EngineStats.parse(stats)
    v.model = str(s.model or "-")
    v.kv_profile = str(s.settings.kv_profile or "-")
    v.spec_backend = s.settings.spec_backend
    v.cache_mode = s.settings.cache_mode
    v.profile = _stem(s.settings.profile) if s.settings.profile else None
    v.uptime_s = s.uptime_s
    v.max_concurrency = s.max_concurrency
    v.running, v.waiting, v.prefilling = s.requests.running, s.requests.waiting, s.requests.prefilling
    v.fatal = s.fatal

    v.cache_on = s.cache is not None
    cache = s.cache if s.cache is not None else NO_CACHE
    v.pool = cache.pool
    snaps = cache.snapshots
    # superseded snapshots whose image still sits in a device slot (only known from rows)
    sup_on_dev = sum(1 for r in snaps.rows if r.superseded and r.residency in ("device", "both")) \
        if snaps.rows is not None else 0
    v.slots = SnapshotSlots(slots=snaps.slots, lanes=s.max_concurrency, active=v.running,
                            snapshot=min(snaps.on_device, snaps.slots_used),
                            staging=max(0, snaps.slots_used - snaps.on_device),
                            superseded=sup_on_dev, image_bytes=snaps.image_bytes)
    v.host = cache.host
    v.snapshots_total = snaps.total
    v.snapshots_by_kind = dict(snaps.by_kind)
    v.snapshots_by_residency = dict(snaps.by_residency)
    v.snapshot_rows = snaps.rows
    v.nodes_total = cache.nodes_total
    v.gdsf_L = cache.gdsf_L
    v.transfers = Transfers(**asdict(cache.transfers))

    c = s.counters
    ttft = list(s.ttft_recent_s)
    v.reuse = Reuse(requests=c.requests, prompt_tokens=c.prompt_tokens, reuse_tokens=c.reuse_tokens,
                    prefill_tokens=c.prefill_tokens,
                    saved_tokens=c.reuse_tokens,  # prompt tokens served from the cache, never prefilled
                    hit_rate=(c.reuse_tokens / c.prompt_tokens) if c.prompt_tokens else None,
                    snapshot_hits=cache.snapshot_hits,
                    ttft_p50=percentile(ttft, 0.5), ttft_p95=percentile(ttft, 0.95), ttft_n=len(ttft))

    v.speculative = s.speculative
    v.experts = s.experts
    return v


# ---------------------------------------------------------------------------------------------
# Sources and the rolling history
# ---------------------------------------------------------------------------------------------
def engine_source(engine: Any, settings: Any = None, *, rows: int = 12,
                  timeout: float = 0.25) -> Callable[[], dict]:
    """Stats from an engine in this process: ``engine.detailed_stats()`` (made by its worker
    between two steps, snapshot rows included; waited for at most ``timeout`` seconds, else
    the published stats with the rows of the last frame that had them), plus the settings'
    names. The view never reads the cache itself: the worker is its only mutator (spec §10.9)."""
    meta = settings_meta(settings)
    last_rows: list = []

    def read() -> dict:
        nonlocal last_rows
        detailed = getattr(engine, "detailed_stats", None)
        stats = to_json((detailed(timeout) if detailed is not None else engine.stats()) or {})
        assert isinstance(stats, dict), "the engine's stats are an object"
        if meta:
            stats.setdefault("settings", meta)
        cache = stats.get("cache")
        if isinstance(cache, dict):
            cache = dict(cache)
            if isinstance(cache.get("top_snapshots"), list):
                cache["top_snapshots"] = last_rows = cache["top_snapshots"][:rows]
            elif last_rows:
                cache["top_snapshots"] = last_rows
            stats["cache"] = cache
        return stats

    return read


def settings_meta(settings: Any) -> dict:
    """The names the header shows, from a ResolvedSettings (or HpcSettings)."""
    if settings is None:
        return {}
    s = getattr(settings, "settings", settings)
    out: dict[str, Any] = {}
    try:
        out["kv_profile"] = s.kv.profile
        out["speculative_backend"] = s.speculative.backend
        out["cache_mode"] = s.cache.mode
    except AttributeError:
        pass
    path = getattr(settings, "profile_path", None)
    out["profile_path"] = str(path) if path is not None else None
    return out


def url_source(url: str, api_key: str | None = None, timeout: float = 3.0) -> Callable[[], dict]:
    """Stats from a running server's ``/v1/cache/stats``; failures raise :class:`SourceGone`."""
    import httpx

    base = url.rstrip("/")
    endpoint = base if base.endswith("/v1/cache/stats") else base + "/v1/cache/stats"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(timeout=timeout, headers=headers, trust_env=False)

    def read() -> dict:
        try:
            r = client.get(endpoint)
        except httpx.TransportError as exc:
            kind = ("connection refused" if isinstance(exc, httpx.ConnectError) else "timed out"
                    if isinstance(exc, httpx.TimeoutException) else "connection closed"
                    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)) else type(exc).__name__)
            raise SourceGone(f"cannot reach {base} ({kind})") from None
        if r.status_code == 401:
            raise SourceGone(f"{base} refused the API key (HTTP 401); pass --api-key KEY")
        if r.status_code == 404:
            raise SourceGone(f"{base} has no /v1/cache/stats (HTTP 404); is it an hpc-cli server?")
        if r.status_code != 200:
            raise SourceGone(f"{base}/v1/cache/stats answered HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise SourceGone(f"{base}/v1/cache/stats did not answer JSON") from None
        if not isinstance(data, dict):
            raise SourceGone(f"{base}/v1/cache/stats did not answer a JSON object")
        return data

    read.endpoint = endpoint  # type: ignore[attr-defined]
    return read


@dataclass(slots=True)
class _Sample:
    t: float
    prompt: int
    reuse: int
    restored_bytes: int
    restores: int
    writes_landed: int
    written_bytes: int | None
    ttft_p50: float | None
    running: int
    waiting: int


class Collector:
    """Reads a source and keeps one minute of samples for rates and sparklines."""

    def __init__(self, read: Callable[[], dict], source: str = "", *, clock: Callable[[], float] = time.monotonic,
                 history_s: float = HISTORY_S, rate_window_s: float = 5.0) -> None:
        self.read = read
        self.source = source
        self.clock = clock
        self.history_s = history_s
        self.rate_window_s = rate_window_s
        self.samples: deque[_Sample] = deque()
        self.frames = 0  # stats read so far (a failure after the first means the source went away)

    def poll(self) -> View:
        view = self.update(self.read())
        self.frames += 1
        return view

    def update(self, stats: dict) -> View:
        """Fold one stats dict into the history and return its view (pure but for the history)."""
        v = build_view(stats, self.source)
        now = self.clock()
        t = v.transfers
        self.samples.append(_Sample(now, v.reuse.prompt_tokens, v.reuse.reuse_tokens, t.restored_bytes_total,
                                    t.restores_total, t.writes_landed_total, t.written_bytes_total,
                                    v.reuse.ttft_p50, v.running, v.waiting))
        while self.samples and now - self.samples[0].t > self.history_s:
            self.samples.popleft()
        self._rates(v, now)
        self._sparks(v)
        return v

    def _rates(self, v: View, now: float) -> None:
        base = None
        for s in self.samples:  # the oldest sample within the rate window
            if now - s.t <= self.rate_window_s:
                base = s
                break
        last = self.samples[-1]
        if base is None or last.t - base.t <= 0:
            return
        dt = last.t - base.t
        t = v.transfers
        t.restore_gbps = max(0, last.restored_bytes - base.restored_bytes) / dt / 1e9
        t.restores_per_s = max(0, last.restores - base.restores) / dt
        t.writes_per_s = max(0, last.writes_landed - base.writes_landed) / dt
        if last.written_bytes is not None and base.written_bytes is not None:
            t.write_gbps = max(0, last.written_bytes - base.written_bytes) / dt / 1e9

    def _sparks(self, v: View) -> None:
        s = list(self.samples)
        # an interval with no finished prompt repeats the last rate (it is no miss)
        rate = (s[0].reuse / s[0].prompt) if s and s[0].prompt else 0.0
        for a, b in zip(s, s[1:]):
            dt = max(b.t - a.t, 1e-9)
            dp = b.prompt - a.prompt
            if dp > 0:
                rate = max(0, b.reuse - a.reuse) / dp
            v.spark_hit_rate.append(rate)
            v.spark_reuse_tps.append(max(0, b.reuse - a.reuse) / dt)
            v.spark_restore_gbps.append(max(0, b.restored_bytes - a.restored_bytes) / dt / 1e9)
        v.spark_ttft = [x.ttft_p50 or 0.0 for x in s]
        v.spark_running = [float(x.running) for x in s]
        v.spark_waiting = [float(x.waiting) for x in s]
