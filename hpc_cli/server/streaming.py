"""Engine events to responses, for every generating route of both APIs.

:func:`stream_events` is the one server-sent-events loop: it tracks the request
(:class:`.tracking.RequestTracker`), assembles the text (stop ids and stop strings,
:class:`.common.TextAssembler`), cancels the engine request once a stop string ended it, and
owns the epilogue: an engine failure (``unavailable`` 503, ``error`` 500) becomes one error event
and ends the stream, a finish counts ``ok``, a client that went away counts ``cancelled``, and
a request still running when the stream ends is cancelled. What the events look like on the
wire is the route's :class:`StreamWriter` (:class:`.openai_common.OpenAIStreamWriter` for
``data:`` chunks ending in ``[DONE]``, :class:`.messages.MessagesStreamWriter` for Anthropic's
named events).

:func:`collect` is the same for a response sent whole: the generated tokens, the assembled text
and the finish event; :func:`raise_for_finish` turns a failed finish into the error response.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from hpc_cli.engine.api import AdmittedEvent, FinishEvent, FinishReason, RequestHandle, TokenEvent
from hpc_cli.errors import EngineError
from hpc_cli.server.common import (ClientDisconnected, TextAssembler, Unavailable, iterate_event_batches,
                                  iterate_events)
from hpc_cli.server.tracking import RequestTracker

if TYPE_CHECKING:
    from hpc_cli.server.state import ServerState
    from hpc_cli.server.timing import ServerMarks

#: a failed finish's reason -> the HTTP status and the message when the engine gave none
FAILURES: dict[FinishReason, tuple[int, str]] = {
    FinishReason.UNAVAILABLE: (503, "the server is stopping; the request was not completed"),
    FinishReason.ERROR: (500, "the engine failed this request"),
}
DONE = "data: [DONE]\n\n"


def sse_data(data: Any) -> str:
    """One unnamed event (OpenAI's chunks)."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(event: str, data: dict) -> str:
    """One named event (Anthropic's)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def raise_for_finish(fin: FinishEvent) -> None:
    """A failed finish as the error the exception handlers answer (503 or 500, no traceback)."""
    if fin.reason == FinishReason.UNAVAILABLE:
        raise Unavailable(fin.error or FAILURES[FinishReason.UNAVAILABLE][1])
    if fin.reason == FinishReason.ERROR:
        raise EngineError(fin.error or FAILURES[FinishReason.ERROR][1])


def settle_reason(fin: FinishEvent, asm: TextAssembler) -> None:
    """A request the server cancelled because a stop string ended its text finished by ``stop``."""
    if fin.reason == FinishReason.CANCELLED and asm.stopped is not None:
        fin.reason = FinishReason.STOP


class StreamWriter:
    """How one route writes its stream: each method returns the events to send, in order.
    ``marks``: the request's :class:`~hpc_cli.server.timing.ServerMarks` (the stream notes the
    first chunk with output written in it), or None."""

    marks: "ServerMarks | None" = None
    #: whether :meth:`admitted` may send something (else the admission does not wake the loop)
    sends_at_admission = False

    def opening(self) -> Iterable[str]:
        """Before any engine event."""
        return ()

    def admitted(self, ev: AdmittedEvent) -> Iterable[str]:
        return ()

    def token(self, ev: TokenEvent, piece: str) -> Iterable[str]:
        """A generated token (not after a stop) and the text it released (may be empty)."""
        raise NotImplementedError

    def finish(self, fin: FinishEvent, tail: str) -> Iterable[str]:
        """The request finished (``stop``, ``length`` or ``cancelled``); ``tail``: the text held
        back until now."""
        raise NotImplementedError

    def error(self, status: int, message: str, code: str) -> Iterable[str]:
        """The engine failed the request (``code`` ``unavailable`` or ``error``)."""
        raise NotImplementedError


async def stream_events(state: "ServerState", request: Request, handle: RequestHandle, endpoint: str,
                        asm: TextAssembler, writer: StreamWriter) -> AsyncIterator[str]:
    """The stream of one engine request (see the module's docstring). The events the engine has
    put by the time the loop reads them (a speculative round's tokens) go to the connection in
    one write, each still its own server-sent event."""
    tracker = RequestTracker(state, endpoint)
    outcome = "error"
    try:
        for s in writer.opening():
            yield s
        async for batch in iterate_event_batches(handle, request.is_disconnected,
                                                 wake_on_admission=writer.sends_at_admission):
            out: list[str] = []
            ended = False
            for ev in batch:
                if isinstance(ev, AdmittedEvent):
                    out.extend(writer.admitted(ev))
                elif isinstance(ev, TokenEvent):
                    tracker.token()
                    if asm.stopped is not None:
                        continue
                    piece = asm.push(ev.token_id)
                    if asm.stopped is not None:
                        handle.cancel()  # the engine stops at the same token; this only makes sure
                    chunks = list(writer.token(ev, piece))
                    if chunks and writer.marks is not None:
                        # its chunk goes to the connection with this batch (the first one counts);
                        # marked after the yield it would also count whatever other requests'
                        # work the event loop ran before resuming this stream
                        writer.marks.sent()
                    out.extend(chunks)
                elif isinstance(ev, FinishEvent):
                    ended = True
                    if ev.reason in FAILURES:
                        outcome = ev.reason
                        tracker.finish(outcome, ev.usage)
                        status, default = FAILURES[ev.reason]
                        out.extend(writer.error(status, ev.error or default, ev.reason))
                        break
                    tail = asm.finish()
                    settle_reason(ev, asm)
                    out.extend(writer.finish(ev, tail))
                    outcome = "ok"
                    tracker.finish("ok", ev.usage, writer.marks)
            if out:
                yield "".join(out)
            if ended:
                return
    except ClientDisconnected:
        outcome = "cancelled"  # the client went away
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"  # the stream was closed under it: the client went away
        raise
    finally:
        if handle.finished is None:
            handle.cancel()
        tracker.finish(outcome)


async def collect(state: "ServerState", request: Request, handle: RequestHandle, tracker: RequestTracker,
                  stop: tuple[str, ...], skip: set[int]) -> tuple[list[TokenEvent], TextAssembler, FinishEvent]:
    """One engine request read to its end: the tokens up to a stop, their text, the finish."""
    asm = TextAssembler(state.tokenizer, stop, skip)
    tokens: list[TokenEvent] = []
    async for ev in iterate_events(handle, request.is_disconnected):
        if isinstance(ev, TokenEvent):
            tracker.token()
            if asm.stopped is None:
                tokens.append(ev)
                asm.push(ev.token_id)
                if asm.stopped is not None:
                    handle.cancel()  # the engine stops at the same token; this only makes sure
        elif isinstance(ev, FinishEvent):
            asm.finish()
            settle_reason(ev, asm)
            return tokens, asm, ev
    raise RuntimeError("event stream ended without a FinishEvent")
