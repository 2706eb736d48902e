"""/metrics through prometheus_client: one :class:`CollectorRegistry` per app (no global state).

Server-side metrics (requests by endpoint and outcome, prompt/cached/prefill/completion tokens,
host restores and their bytes, the cache hit rate, time to first token, inter-token latency,
the per-request phases and the prefill passes) are prometheus_client Counters, Gauges and
Histograms on the app's registry, next to the process, platform and garbage-collector
collectors. The engine's ``stats()`` document is flattened into gauges ``hpc_engine_<path>``
(cache residency on device and host, evictions, pools, ...) by :class:`EngineStatsCollector`, so
whatever the engine reports is exported without a second list of names; a ``compilations``
count in it is also the counter ``hpc_kernel_compilations_total``.

:meth:`Metrics.exposition` negotiates the format from the Accept header (Prometheus text 0.0.4
by default, OpenMetrics when asked for).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hpc_cli.engine.api import PHASES, Usage
from hpc_cli.server.timing import SERVER_PHASES

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)
PASS_TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# The label values the server uses; anything else is a bug, refused before it becomes a series.
ENDPOINTS = ("chat", "completions", "messages")
# "cancelled": the client went away (a disconnect mid-stream or while waiting), not an error
OUTCOMES = ("ok", "error", "unavailable", "cancelled")

StatsDoc = Mapping[str, object]


class EngineStatsCollector(Collector):
    """The numeric leaves of an engine ``stats()`` document as gauges ``hpc_engine_<path>``, and
    its ``compilations`` count (if it reports one) as ``hpc_kernel_compilations_total``.
    ``document`` gives the document to export at collection time (``None``: nothing)."""

    def __init__(self, document: Callable[[], StatsDoc | None]) -> None:
        self._document = document

    def describe(self) -> list[Metric]:
        return []  # the names follow the document: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats = self._document()
        if not stats:
            return
        for name, (path, value) in _leaves(stats).items():
            yield GaugeMetricFamily(name, f"engine stats(): {path}", value=value)
        compilations = kernel_compilations(stats)
        if compilations is not None:
            yield CounterMetricFamily("hpc_kernel_compilations", "kernel compilations counted by the engine",
                                      value=compilations)


def kernel_compilations(stats: StatsDoc) -> float | None:
    """``stats["compilations"]`` when it is a count (or a mapping with a numeric ``total``)."""
    value = stats.get("compilations")
    if isinstance(value, Mapping):
        value = value.get("total")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Metrics:
    """The app's metrics on its own registry; thread-safe (prometheus_client's metrics are)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self._lock = threading.Lock()
        self._prompt_total = 0
        self._cached_total = 0
        self._expose_lock = threading.Lock()
        self._stats: StatsDoc | None = None  # the document of the exposition in progress

        self.requests = Counter("hpc_requests", "requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=reg)
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint=endpoint, outcome=outcome)
        self.running = Gauge("hpc_requests_running", "requests being served", registry=reg)
        self.prompt_tokens = Counter("hpc_prompt_tokens", "prompt tokens of finished requests", registry=reg)
        self.cached_tokens = Counter("hpc_cached_tokens", "prompt tokens reused from the prefix cache (reuse_tokens)",
                                     registry=reg)
        self.prefill_tokens = Counter("hpc_prefill_tokens", "prompt tokens prefilled", registry=reg)
        self.completion_tokens = Counter("hpc_completion_tokens", "generated tokens", registry=reg)
        Gauge("hpc_cache_hit_rate", "cached_tokens_total / prompt_tokens_total", registry=reg) \
            .set_function(self._hit_rate)
        self.restores = Counter("hpc_host_restores", "requests that restored from the host tier", registry=reg)
        self.restored_bytes = Counter("hpc_host_restored_bytes", "bytes restored from the host tier", registry=reg)
        self.ttft = Histogram("hpc_time_to_first_token_seconds", "submit to first token", buckets=TTFT_BUCKETS,
                              registry=reg)
        self.itl = Histogram("hpc_inter_token_latency_seconds", "gap between streamed tokens", buckets=ITL_BUCKETS,
                             registry=reg)
        phase = Histogram("hpc_request_phase_seconds",
                          "seconds of each finished request in each phase (host time on the engine thread; "
                          "phases are disjoint, once per request, zero included)",
                          ["phase"], buckets=PHASE_BUCKETS, registry=reg)
        self.phases = {name: phase.labels(phase=name) for name in PHASES}
        server = Histogram("hpc_server_phase_seconds",
                           "the server's own seconds of each finished request: prepare (request taken to "
                           "submitted: template, tokenizer, images), first_send (the engine's first token to "
                           "the first chunk with output written; streamed requests)",
                           ["phase"], buckets=PHASE_BUCKETS, registry=reg)
        self.server_phases = {name: server.labels(phase=name) for name in SERVER_PHASES}
        self.pass_seconds = Histogram("hpc_prefill_pass_seconds", "seconds of each prefill pass (less restore "
                                      "waits and taps)", buckets=PHASE_BUCKETS, registry=reg)
        self.pass_tokens = Histogram("hpc_prefill_pass_tokens", "tokens of each prefill pass",
                                     buckets=PASS_TOKEN_BUCKETS, registry=reg)
        reg.register(EngineStatsCollector(lambda: self._stats))

    # --- observations ---------------------------------------------------------------------------
    def request_done(self, endpoint: str, outcome: str) -> None:
        if endpoint not in ENDPOINTS or outcome not in OUTCOMES:
            raise ValueError(f"unknown request label endpoint={endpoint!r} outcome={outcome!r}")
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def add_running(self, delta: int) -> None:
        self.running.inc(delta)

    def usage(self, usage: Usage) -> None:
        with self._lock:
            self._prompt_total += usage.prompt_tokens
            self._cached_total += usage.reuse_tokens
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.reuse_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.prefill_tokens.inc(usage.prefill_tokens)
        if usage.restored_host_bytes:
            self.restores.inc()
            self.restored_bytes.inc(usage.restored_host_bytes)
        if usage.time_to_first_token is not None:
            self.ttft.observe(usage.time_to_first_token)
        self.timing(usage)

    def timing(self, usage: Usage) -> None:
        """The request's phases (once each) and its prefill passes."""
        for name, seconds in usage.timing.phases().items():
            self.phases[name].observe(seconds)
        for p in usage.timing.passes:
            self.pass_seconds.observe(p.seconds)
            self.pass_tokens.observe(p.tokens)

    def server(self, phases: dict[str, float]) -> None:
        """The server's phases of a finished request (:meth:`hpc_cli.server.timing.ServerMarks.phases`)."""
        for name, seconds in phases.items():
            self.server_phases[name].observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    # --- exposition -----------------------------------------------------------------------------
    def exposition(self, engine_stats: StatsDoc | None, accept: str | None = None) -> tuple[bytes, str]:
        """The registry with ``engine_stats`` as its engine gauges, in the format the Accept
        header asks for: ``(body, content type)``."""
        encoder, content_type = choose_encoder(accept or "")
        with self._expose_lock:
            self._stats = engine_stats
            try:
                return encoder(self.registry), content_type
            finally:
                self._stats = None

    def render(self, engine_stats: StatsDoc | None = None) -> str:
        """Prometheus text (0.0.4) with ``engine_stats`` as the engine gauges."""
        return self.exposition(engine_stats)[0].decode()


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")

# Lists that are rows or samples, not a fixed set of gauges: per-snapshot rows (their ids and
# number change every few seconds, so by index they would be a new series each time) and the
# recent time-to-first-token samples (exported as the hpc_time_to_first_token_seconds histogram).
SKIPPED_KEYS = frozenset({"top_snapshots", "ttft_recent_s"})


def _leaves(stats: StatsDoc, prefix: str = "hpc_engine") -> dict[str, tuple[str, float | int]]:
    """Prometheus name -> (dotted path, value) for the numeric leaves of a nested document."""
    out: dict[str, tuple[str, float | int]] = {}

    def walk(value: object, name: str, path: str) -> None:
        if isinstance(value, bool):
            out[name] = (path, int(value))
        elif isinstance(value, (int, float)):
            out[name] = (path, value)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if k in SKIPPED_KEYS:
                    continue
                walk(v, f"{name}_{_NAME_BAD.sub('_', str(k))}", f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}_{i}", f"{path}[{i}]")

    walk(stats, prefix, "")
    return out


def flatten_stats(stats: StatsDoc, prefix: str = "hpc_engine") -> dict[str, float | int]:
    """Numeric leaves of a nested dict as Prometheus names (lists by index); strings, ``None``
    and the row lists in :data:`SKIPPED_KEYS` are left out."""
    return {name: value for name, (_, value) in _leaves(stats, prefix).items()}


def add_engine_fatal_gauge(metrics: Metrics, fatal: Callable[[], str | None]) -> Gauge:
    """``hpc_engine_fatal``: 1 once the engine stopped after an error (``fatal()`` says why), else 0."""
    gauge = Gauge("hpc_engine_fatal", "1 once the engine stopped after an error (/health says why)",
                  registry=metrics.registry)
    gauge.set_function(lambda: 1.0 if fatal() else 0.0)
    return gauge
