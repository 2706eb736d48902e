"""The engine's stats: published by the worker a few times a second (running counts, O(1);
``Engine.stats``, /metrics) and made fresh with the snapshot table for a client that asks
(``Engine.detailed_stats``, /v1/cache/stats, ``hpc-cli top``), as the types of
:mod:`hpc_cli.engine.stats_types`."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hpc_cli.engine.core import EngineCore
from hpc_cli.engine.stats_types import EngineStats, RequestCounts, RunSettings


@dataclass(slots=True, eq=False)
class StatsRequest:
    """A client's request for detailed stats, answered by the worker between two steps."""

    done: threading.Event = field(default_factory=threading.Event)
    result: EngineStats | None = None


class StatsPublisher(EngineCore):
    """Takes and publishes the stats (mixed into the engine)."""

    _stats_lock: threading.Lock
    _stats_snapshot: EngineStats | None
    settings: Any  # the HpcSettings it was built from (a ``profile_path`` attribute), or None

    def _take_stats(self, *, detailed: bool = False) -> EngineStats:
        """Publish the stats (running counts: O(1) in the size of the cache) and return them;
        ``detailed`` returns them with the snapshot table as well (a walk; clients only)."""
        cache = self.cache.stats(detailed=detailed)
        now = time.monotonic()
        expert_tier = getattr(self.model, "expert_tier", None)
        snap = EngineStats(
            model=self.model_name, kv_profile=self.kv_profile.name, max_concurrency=self.C,
            prefill_chunk=self.chunk, uptime_s=time.time() - self.started_at,
            requests=RequestCounts(running=len(self._lanes), waiting=len(self._waiting),
                                   prefilling=sum(1 for l in self._lanes if l.prefilling)),
            counters=dict(self.counters), cache=cache, ttft_recent_s=[t for at, t in self.ttft if now - at <= 60],
            fatal=self.fatal, compilations=self.compile_counts.since_warm,
            kernel_compilations=self.compile_counts.stats(),
            experts=expert_tier.stats() if expert_tier is not None else None,
            speculative=self.spec.stats() if self.spec is not None else None,
            settings=self._settings_meta())
        published = snap
        if detailed:
            published = dataclasses.replace(snap, cache=dataclasses.replace(cache, top_snapshots=None))
        with self._stats_lock:
            self._stats_snapshot = published
        return snap

    def _settings_meta(self) -> RunSettings:
        """The names a client shows next to the stats (``hpc-cli top``'s header)."""
        path = getattr(self.settings, "profile_path", None)
        return RunSettings(kv_profile=self.kv_profile.name,
                           speculative_backend=getattr(self.spec_backend, "name", None) or "none",
                           cache_mode=self.cache_mode.name, profile_path=str(path) if path is not None else None)
