"""Per-request accounting shared by every generating route: the running gauge, inter-token gaps,
the final usage, the outcome (``ok``, ``cancelled``, ``unavailable``, ``error``) in
``/metrics`` and the request log line (:mod:`.reqlog`).

A :class:`RequestTracker` per engine request; :func:`tracked` makes them for a request's
handles and, when the route fails, cancels every handle and counts each with the failure's
outcome (:func:`outcome_of`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

from hpc_cli.engine.api import RequestHandle, Usage
from hpc_cli.server.common import ClientDisconnected, Unavailable
from hpc_cli.server.reqlog import log_request

if TYPE_CHECKING:
    from hpc_cli.server.state import ServerState
    from hpc_cli.server.timing import ServerMarks


class RequestTracker:
    """One engine request's metrics: inter-token gaps and the final usage, counted once."""

    def __init__(self, state: "ServerState", endpoint: str) -> None:
        self.state, self.endpoint, self.last = state, endpoint, None
        state.metrics.add_running(1)
        self.done = False
        self.started = time.monotonic()

    def token(self) -> None:
        now = time.monotonic()
        if self.last is not None:
            self.state.metrics.inter_token(now - self.last)
        self.last = now

    def finish(self, outcome: str, usage: Usage | None = None, marks: "ServerMarks | None" = None) -> None:
        """Count the request once: its outcome, and its usage and the server's phases (``marks``)
        when it has them."""
        if self.done:
            return
        self.done = True
        self.state.metrics.add_running(-1)
        if usage is not None:
            self.state.metrics.usage(usage)
            if marks is not None:
                self.state.metrics.server(marks.phases(usage))
        self.state.metrics.request_done(self.endpoint, outcome)
        log_request(self.endpoint, outcome, usage, time.monotonic() - self.started)


def outcome_of(exc: BaseException) -> str:
    """The outcome a request that raised ``exc`` is counted with."""
    if isinstance(exc, (ClientDisconnected, asyncio.CancelledError, GeneratorExit)):
        return "cancelled"  # the client went away
    if isinstance(exc, Unavailable):
        return "unavailable"
    return "error"


@contextmanager
def tracked(state: "ServerState", endpoint: str, handles: Sequence[RequestHandle]
            ) -> Iterator[list[RequestTracker]]:
    """A tracker per handle; on an exception every handle is cancelled and every tracker not yet
    finished counts the exception's outcome."""
    trackers = [RequestTracker(state, endpoint) for _ in handles]
    try:
        yield trackers
    except BaseException as exc:
        for h, tr in zip(handles, trackers):
            h.cancel()
            tr.finish(outcome_of(exc))
        raise
