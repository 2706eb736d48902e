"""A lane's end: the binding publishes and releases it (spec §7.7), the finish event goes out
with its usage; a failed request ends alone; a stop or a fatal error ends every lane."""

from __future__ import annotations

import logging
import time
from typing import Iterable

from hpc_cli.engine.api import FinishEvent, FinishReason
from hpc_cli.engine.core import EngineCore
from hpc_cli.engine.lane import Lane
from hpc_cli.errors import HpcError

log = logging.getLogger("hpc_cli.engine")


class Finish(EngineCore):
    """Ends lanes (mixed into the engine)."""

    def _fail_lane(self, lane: Lane, exc: Exception) -> None:
        """End ``lane`` with reason "error" at the next step (published: nothing), keep serving."""
        message = exc.message if isinstance(exc, HpcError) else f"{type(exc).__name__}: {exc}"
        log.warning("request %s failed: %s", lane.request.request_id, message,
                    exc_info=None if isinstance(exc, HpcError) else exc)
        lane.finish_reason, lane.error = FinishReason.ERROR, f"the request failed in the engine: {message}"
        lane.next_token = None

    #: the longest the worker waits, after emitting first or last tokens and before host work
    #: that delays nothing on the device (a pass's commits and taps, a lane's end), for the
    #: server to have sent them: its event loop needs the interpreter to send, and each write
    #: that gives it up to the kernel would otherwise wait out the worker's Python work
    DELIVER_MAX_S = 0.003

    def _send_held(self) -> None:
        """Hand the tokens held since they were chosen (``hold_tokens``) to the server, in order.
        The worker calls it once the next decode step (or verify pass) is launched (the device
        computes while the server's event loop, which needs the interpreter, sends them), and
        before a prefill pass and a lane's end: a held token's lane either decodes on or ends at
        the worker's next step, so none waits longer than that."""
        held, self._held = self._held, []
        for lane, ev in held:
            lane.handle.put(ev)

    def _deliver(self, lanes: Iterable[Lane]) -> None:
        """Let the server send the tokens just emitted to ``lanes`` before the host work that
        follows (no wait for a consumer that does not acknowledge, such as ``result()``)."""
        self._send_held()
        deadline = time.monotonic() + self.DELIVER_MAX_S
        for lane in lanes:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            lane.handle.wait_sent(left)

    def _finish_lanes(self, lanes: list[Lane], *, deliver: bool = True) -> None:
        """End ``lanes`` (their last tokens sent first, unless ``deliver`` is False because the
        caller let them go already); a failed lane leaves nothing."""
        if not lanes:
            return
        if deliver:
            self._deliver(lanes)
        for lane in lanes:
            self._finish(lane, publish=lane.finish_reason != FinishReason.ERROR)

    def _finish(self, lane: Lane, *, publish: bool = True) -> None:
        t0 = time.perf_counter()
        if self.spec is not None and publish:
            self.spec.before_finish(lane)
        self.cache.finish(lane, publish=publish)
        self._lanes.remove(lane)
        lane.usage.timing.finish = time.perf_counter() - t0
        self._emit_finish(lane)

    def _emit_finish(self, lane: Lane) -> None:
        self._send_held()  # the lane's last tokens go before its end
        self._by_id.pop(lane.request.request_id, None)
        reason = lane.finish_reason or FinishReason.STOP
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += lane.n_prompt
        self.counters["reuse_tokens"] += lane.usage.reuse_tokens
        self.counters["cached_prefix_tokens"] += lane.usage.cached_prefix_tokens
        lane.handle.put(FinishEvent(reason, lane.usage, error=lane.error,
                                    stop_text=getattr(lane, "stop_text", None),
                                    prompt_logprobs=lane.prompt_logprobs,
                                    prompt_top_logprobs=lane.prompt_top_logprobs))

    def _shutdown(self, reason: FinishReason, message: str, *, publish: bool = True) -> None:
        self._drain_inbox()
        for lane in list(self._lanes):
            lane.finish_reason, lane.error = reason, message
            try:
                self._finish(lane, publish=publish)
            except Exception:  # never leave a caller waiting
                if lane in self._lanes:
                    self._lanes.remove(lane)
                self._emit_finish(lane)
        while self._waiting:
            lane = self._waiting.popleft()
            lane.finish_reason, lane.error = reason, message
            self._emit_finish(lane)
