"""Per-request phase timing in the usage: ``usage.hpc_timing``, when asked for.

A request asks with ``"hpc": {"timing": true}`` in its body (the openai client's
``extra_body={"hpc": {"timing": True}}``; the anthropic client's ``extra_body`` the same);
``[server] debug_timing`` (``HPC_SERVER__DEBUG_TIMING``, ``serve --debug-timing``) adds it to
every response, and ``"hpc": {"timing": false}`` turns it off for one request. The value is
:meth:`hpc_cli.engine.api.RequestTiming.phases` (seconds per phase, disjoint, so they add up to
no more than the request's wall time) plus the prefill passes, the number of taps and
``time_to_first_token``: the engine's seconds from submit to the first token (what the client
waits beyond it is the server's own part: the HTTP exchange, the template and the tokenizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, StrictBool

from hpc_cli.engine.api import Usage

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


def timing_doc(usage: Usage) -> TimingDoc:
    """``usage.hpc_timing``: seconds per phase, then the passes, the taps and the engine's time
    to the first token."""
    timing = usage.timing
    doc: TimingDoc = dict(timing.phases())
    doc["prefill_passes"] = [{"seconds": p.seconds, "tokens": p.tokens} for p in timing.passes]
    doc["taps"] = timing.taps
    if usage.time_to_first_token is not None:
        doc["time_to_first_token"] = usage.time_to_first_token
    return doc


def with_timing(usage_doc: dict[str, object], usage: Usage | None, on: bool) -> dict[str, object]:
    """``usage_doc`` with ``hpc_timing`` added when ``on`` (and the engine's usage is known)."""
    if on and usage is not None:
        usage_doc["hpc_timing"] = timing_doc(usage)
    return usage_doc
