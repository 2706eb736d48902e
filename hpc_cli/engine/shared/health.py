"""The shared store's health as the tier sees it: after a failure it stops asking for a while
(0.5 s, doubling to 10 s) and logs one warning per outage (docs/shared-cache.md)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("hpc_cli.engine.shared")


class Health:
    """Whether the store answers: after a failure the tier stops asking until ``retry_at``
    (0.5 s, doubling to 10 s while failures go on); one warning per outage, one line when it
    answers again. Shared by the writer and lookup threads and read by the worker."""

    FIRST_S, MAX_S = 0.5, 10.0

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self.down = False
        self.retry_at = 0.0
        self.backoff = self.FIRST_S
        self.outages = 0
        self.last_error: str | None = None

    def available(self) -> bool:
        return not self.down or time.monotonic() >= self.retry_at

    def ok(self) -> None:
        if not self.down:
            return
        with self._lock:
            if self.down:
                self.down = False
                self.backoff = self.FIRST_S
                log.warning("shared cache %s is reachable again", self.where)

    def failed(self, exc: Exception) -> None:
        with self._lock:
            self.last_error = str(exc)
            first = not self.down
            self.down = True
            self.retry_at = time.monotonic() + self.backoff
            if first:
                self.outages += 1
                log.warning("shared cache %s unavailable (%s); serving from the device and host tiers, "
                            "retrying from %.1f s on", self.where, exc, self.backoff)
            self.backoff = min(2 * self.backoff, self.MAX_S)
