"""Per-request phase timing in the usage: ``usage.hpc_timing``, when asked for.

A request asks with ``"hpc": {"timing": true}`` in its body (the openai client's
``extra_body={"hpc": {"timing": True}}``; the anthropic client's ``extra_body`` the same);
``[server] debug_timing`` (``HPC_SERVER__DEBUG_TIMING``, ``serve --debug-timing``) adds it to
every response, and ``"hpc": {"timing": false}`` turns it off for one request. The value is
:meth:`hpc_cli.engine.api.RequestTiming.phases` (seconds per phase, disjoint, so they add up to
no more than the request's wall time) plus the prefill passes, the number of taps and
``time_to_first_token``: the engine's seconds from submit to the first token, plus the server's
own part of the wait (:class:`ServerMarks`): ``server_prepare`` from the route taking the request
(its body read) to the submit (the template, the tokenizer, the images), and, streamed,
``server_first_send`` from the engine's first token to the first chunk carrying generated output
handed to the connection (a token whose text is held back, a partial UTF-8 character or a
possible stop string, waits for the next). The rest of what a client measures is the HTTP
exchange and the client itself. The same two go to ``/metrics`` as
``hpc_server_phase_seconds{phase="prepare"|"first_send"}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, StrictBool

from hpc_cli.engine.api import RequestHandle, Usage

if TYPE_CHECKING:
    from hpc_cli.server.app import ServerState

Number = float | int
TimingDoc = dict[str, Number | list[dict[str, Number]]]


class HpcOptions(BaseModel):
    """The request body's ``hpc`` object: this server's own options."""

    model_config = ConfigDict(extra="forbid")
    timing: StrictBool | None = None  # usage.hpc_timing for this request (None: the server's setting)


def wants_timing(state: "ServerState", options: HpcOptions | None) -> bool:
    """Whether a response carries ``usage.hpc_timing``: the request's ``hpc.timing`` if it sets
    one, else the server's ``debug_timing``."""
    if options is not None and options.timing is not None:
        return options.timing
    return bool(state.settings.server.debug_timing)


#: the server's phases, in ``usage.hpc_timing`` (``server_`` + name) and ``/metrics``
SERVER_PHASES = ("prepare", "first_send")


@dataclass
class ServerMarks:
    """The server's own moments of one request (``time.monotonic``, the clock of
    :attr:`RequestHandle.submitted_at` and of the engine's first token)."""

    received: float = field(default_factory=time.monotonic)  # the route took the request
    submitted: float | None = None  # handed to the engine
    first_sent: float | None = None  # the first chunk with generated output written

    def submit(self, handle: RequestHandle) -> None:
        self.submitted = handle.submitted_at

    def sent(self) -> None:
        if self.first_sent is None:
            self.first_sent = time.monotonic()

    def phases(self, usage: Usage | None) -> dict[str, float]:
        """Seconds of each of :data:`SERVER_PHASES` known so far."""
        out: dict[str, float] = {}
        if self.submitted is None:
            return out
        out["prepare"] = max(0.0, self.submitted - self.received)
        ttft = usage.time_to_first_token if usage is not None else None
        if self.first_sent is not None and ttft is not None:
            out["first_send"] = max(0.0, self.first_sent - (self.submitted + ttft))
        return out


def timing_doc(usage: Usage, marks: ServerMarks | None = None) -> TimingDoc:
    """``usage.hpc_timing``: seconds per phase, then the passes, the taps and the engine's time
    to the first token, then the server's phases (``marks``)."""
    timing = usage.timing
    doc: TimingDoc = dict(timing.phases())
    doc["prefill_passes"] = [{"seconds": p.seconds, "tokens": p.tokens} for p in timing.passes]
    doc["taps"] = timing.taps
    if usage.time_to_first_token is not None:
        doc["time_to_first_token"] = usage.time_to_first_token
    if marks is not None:
        for name, seconds in marks.phases(usage).items():
            doc[f"server_{name}"] = seconds
    return doc


def with_timing(usage_doc: dict[str, object], usage: Usage | None, on: bool,
                marks: ServerMarks | None = None) -> dict[str, object]:
    """``usage_doc`` with ``hpc_timing`` added when ``on`` (and the engine's usage is known)."""
    if on and usage is not None:
        usage_doc["hpc_timing"] = timing_doc(usage, marks)
    return usage_doc
