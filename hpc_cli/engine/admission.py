"""Admission on the worker: the FIFO head asks the cache binding for pages, a state slot and a
resume point; a blocked head is never overtaken (spec §6.3) and prefetches meanwhile (§6.6)."""

from __future__ import annotations

import time

from hpc_cli.engine.api import AdmittedEvent, FinishReason
from hpc_cli.engine.binding import Blocked
from hpc_cli.engine.core import EngineCore
from hpc_cli.errors import HpcError


class Admission(EngineCore):
    """Admits the FIFO head (mixed into the engine)."""

    def _admit(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if head.finish_reason == FinishReason.CANCELLED:
                self._waiting.popleft()
                self._emit_finish(head)
                continue
            if len(self._lanes) >= self.C or (not self.concurrent_prefill
                                              and any(l.prefilling for l in self._lanes)):
                self.cache.prefetch(head)  # spec §6.6: restore the waiting head's path meanwhile
                return
            try:
                adm = self.cache.admit(head, [l for l in self._lanes if l.prefilling])
            except Blocked:
                self.cache.prefetch(head)
                return  # the FIFO head is never overtaken (spec §6.3)
            except HpcError as exc:
                self._waiting.popleft()
                head.finish_reason, head.error = FinishReason.ERROR, exc.message
                self._emit_finish(head)
                continue
            self._waiting.popleft()
            head.admitted_at = time.monotonic()
            u = head.usage
            u.prompt_tokens = head.n_prompt
            u.reuse_tokens = adm.reuse_tokens
            u.cached_prefix_tokens = adm.cached_prefix_tokens
            u.queue_seconds = head.admitted_at - head.handle.submitted_at
            u.timing.admission = u.queue_seconds
            head.handle.put(AdmittedEvent(adm.reuse_tokens, adm.cached_prefix_tokens))
            self._lanes.append(head)
