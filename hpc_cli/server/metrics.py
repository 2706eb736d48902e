"""Prometheus text exposition, written by hand (no extra dependency).

Server-side counters (requests, prompt/cached/completion tokens, restores and their bytes, time to
first token and inter-token latency histograms) are kept here; the engine's ``stats()`` document
is flattened into gauges ``hpc_engine_<path>`` (cache residency on device and host, evictions,
pools, ...), so whatever the engine reports is exported without a second list of names.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Mapping

from hpc_cli.engine.api import Usage

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(v: float | int) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Thread-safe counters; :meth:`render` gives the /metrics text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prefill_tokens = 0
        self.restores = 0
        self.restored_bytes = 0
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request_done(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def add_running(self, delta: int) -> None:
        with self._lock:
            self.running += delta

    def usage(self, usage: Usage) -> None:
        with self._lock:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.reuse_tokens
            self.completion_tokens += usage.completion_tokens
            self.prefill_tokens += usage.prefill_tokens
            if usage.restored_host_bytes:
                self.restores += 1
                self.restored_bytes += usage.restored_host_bytes
            if usage.time_to_first_token is not None:
                self.ttft.observe(usage.time_to_first_token)

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def render(self, engine_stats: Mapping[str, Any] | None) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(samples)

            metric("hpc_requests_total", "counter", "requests by endpoint and outcome",
                   [f'hpc_requests_total{{endpoint="{_label(e)}",outcome="{_label(o)}"}} {c}'
                    for (e, o), c in sorted(self.requests.items())] or ['hpc_requests_total{endpoint="",outcome=""} 0'])
            metric("hpc_requests_running", "gauge", "requests being served", [f"hpc_requests_running {self.running}"])
            metric("hpc_prompt_tokens_total", "counter", "prompt tokens of finished requests",
                   [f"hpc_prompt_tokens_total {self.prompt_tokens}"])
            metric("hpc_cached_tokens_total", "counter", "prompt tokens reused from the prefix cache (reuse_tokens)",
                   [f"hpc_cached_tokens_total {self.cached_tokens}"])
            metric("hpc_prefill_tokens_total", "counter", "prompt tokens prefilled",
                   [f"hpc_prefill_tokens_total {self.prefill_tokens}"])
            metric("hpc_completion_tokens_total", "counter", "generated tokens",
                   [f"hpc_completion_tokens_total {self.completion_tokens}"])
            rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
            metric("hpc_cache_hit_rate", "gauge", "cached_tokens_total / prompt_tokens_total",
                   [f"hpc_cache_hit_rate {_num(rate)}"])
            metric("hpc_host_restores_total", "counter", "requests that restored from the host tier",
                   [f"hpc_host_restores_total {self.restores}"])
            metric("hpc_host_restored_bytes_total", "counter", "bytes restored from the host tier",
                   [f"hpc_host_restored_bytes_total {self.restored_bytes}"])
            metric("hpc_time_to_first_token_seconds", "histogram", "submit to first token",
                   self.ttft.lines("hpc_time_to_first_token_seconds"))
            metric("hpc_inter_token_latency_seconds", "histogram", "gap between streamed tokens",
                   self.itl.lines("hpc_inter_token_latency_seconds"))
        for name, value in sorted(flatten_stats(engine_stats or {}).items()):
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name} {_num(value)}")
        return "\n".join(lines) + "\n"


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")

# Lists that are rows or samples, not a fixed set of gauges: per-snapshot rows (their ids and
# number change every few seconds, so by index they would be a new series each time) and the
# recent time-to-first-token samples (exported as the hpc_time_to_first_token_seconds histogram).
SKIPPED_KEYS = frozenset({"top_snapshots", "ttft_recent_s"})


def flatten_stats(stats: Mapping[str, Any], prefix: str = "hpc_engine") -> dict[str, float | int]:
    """Numeric leaves of a nested dict as Prometheus names (lists by index); strings, ``None``
    and the row lists in :data:`SKIPPED_KEYS` are left out."""
    out: dict[str, float | int] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if k in SKIPPED_KEYS:
                    continue
                walk(v, f"{name}_{_NAME_BAD.sub('_', str(k))}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}_{i}")

    walk(stats, prefix)
    return out
