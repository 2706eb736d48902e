"""Pieces both protocols share: error bodies, the bridge from engine events to asyncio, text
assembly (incremental decoding, stop strings, the reasoning split) and request validation helpers.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from pydantic import BaseModel, ValidationError

from hpc_cli.engine.api import AdmittedEvent, Event, FinishEvent, RequestHandle, TokenEvent
from hpc_cli.errors import RequestError
from hpc_cli.model.tokenizer import IncrementalDecoder

ANTHROPIC_PREFIXES = ("/v1/messages",)


# ---------------------------------------------------------------------------------------------
# Errors in each API's own shape
# ---------------------------------------------------------------------------------------------

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                 503: "service_unavailable_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIXES)


def openai_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return openai_error_body(status, message, param, code)


class ClientDisconnected(Exception):
    """The HTTP client went away; the request was cancelled."""


class Unavailable(Exception):
    """The server is stopping (spec §5.5): the request was refused or failed as unavailable."""

    def __init__(self, message: str = "the server is stopping; the request was not served") -> None:
        super().__init__(message)
        self.message = message


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------

def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object within the server's limits (:mod:`hpc_cli.server.validate`)."""
    from hpc_cli.server.validate import parse_json_object

    return parse_json_object(raw)


def validate_model(model_cls: type[BaseModel], data: dict) -> Any:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
        msg = err["msg"]
        extra = f" (and {len(exc.errors()) - 1} more errors)" if len(exc.errors()) > 1 else ""
        raise RequestError(f"{loc}: {msg}{extra}" if loc else msg + extra, param=loc or None,
                           code="invalid_value") from None


# ---------------------------------------------------------------------------------------------
# Engine events on the event loop
# ---------------------------------------------------------------------------------------------

class DisconnectWatch:
    """Asks ``is_disconnected`` at most every ``every`` seconds, however many handles and events
    go by: one watch per HTTP request, shared by all the engine requests it fans out to (a
    fresh timer per handle would never fire when each handle finishes quickly)."""

    SCOPE_KEY = "hpc.disconnect_watch"

    def __init__(self, is_disconnected: Callable[[], Awaitable[bool]], every: float = 0.25) -> None:
        self._ask = is_disconnected
        self.every = every
        self._last = time.monotonic()
        self.gone = False

    @classmethod
    def of(cls, disconnected: "Callable[[], Awaitable[bool]] | DisconnectWatch", every: float = 0.25
           ) -> "DisconnectWatch":
        """The watch for ``disconnected``: itself, the one of its HTTP request when it is a bound
        ``Request.is_disconnected`` (kept in the request's scope), else a new one."""
        if isinstance(disconnected, DisconnectWatch):
            return disconnected
        request = getattr(disconnected, "__self__", None)
        scope = getattr(request, "scope", None)
        if isinstance(scope, dict):
            watch = scope.get(cls.SCOPE_KEY)
            if not isinstance(watch, DisconnectWatch):
                watch = scope[cls.SCOPE_KEY] = cls(disconnected, every)
            return watch
        return cls(disconnected, every)

    async def __call__(self) -> bool:
        if self.gone:
            return True
        now = time.monotonic()
        if now - self._last < self.every:
            return False
        self._last = now
        self.gone = bool(await self._ask())
        return self.gone


async def iterate_events(handle: RequestHandle,
                         disconnected: "Callable[[], Awaitable[bool]] | DisconnectWatch | None" = None,
                         poll: float = 0.05, disconnect_every: float = 0.25,
                         wake_on_admission: bool = True) -> AsyncIterator[Event]:
    """The handle's events one at a time (:func:`iterate_event_batches`, flattened)."""
    async for batch in iterate_event_batches(handle, disconnected, poll, disconnect_every, wake_on_admission):
        for event in batch:
            yield event


async def iterate_event_batches(handle: RequestHandle,
                                disconnected: "Callable[[], Awaitable[bool]] | DisconnectWatch | None" = None,
                                poll: float = 0.05, disconnect_every: float = 0.25,
                                wake_on_admission: bool = True) -> AsyncIterator[list[Event]]:
    """Yield the handle's events without a thread per request, each time every event the engine
    has put so far (a speculative round's tokens arrive together: the stream writes them to the
    connection at once, one wake-up and one write of the event loop instead of one a token): the
    engine's ``put`` also wakes the loop, once for the events put before the loop runs (with a
    short poll as a fallback). Stops after the FinishEvent. On a client disconnect (checked
    every ``disconnect_every`` s, between events too, on one timer per HTTP request:
    :class:`DisconnectWatch`) the request is cancelled and :class:`ClientDisconnected` raised; if
    the consumer stops early the request is cancelled.

    ``wake_on_admission=False``: the admission event does not wake the loop (a consumer that
    sends nothing for it reads it with the next event or poll), so the loop does not take the
    interpreter while the worker goes on from admission to launching the first prefill pass."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    original_put = handle.put
    # whether a wake-up is on its way to the loop: the events put before it runs need no other
    # (each is in the queue before the flag is read; the wake clears the flag before it sets
    # ``ready``, and the loop reads the queue after that)
    waking = False

    def wake() -> None:
        nonlocal waking
        waking = False
        ready.set()

    def put(event: Event) -> None:
        nonlocal waking
        original_put(event)
        if waking or (not wake_on_admission and isinstance(event, AdmittedEvent)):
            return
        waking = True
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is closed
            pass

    handle.put = put  # type: ignore[method-assign]
    handle.acknowledges = True
    watch = DisconnectWatch.of(disconnected, disconnect_every) if disconnected is not None else None
    try:
        while True:
            if watch is not None and await watch():
                raise ClientDisconnected()
            ready.clear()
            batch: list[Event] = []
            while not (batch and isinstance(batch[-1], FinishEvent)):
                try:
                    batch.append(handle.get(timeout=0))
                except queue.Empty:
                    break
            if not batch:
                try:
                    await asyncio.wait_for(ready.wait(), poll)
                except (asyncio.TimeoutError, TimeoutError):
                    pass
                continue
            yield batch
            # the consumer asked for the next events: what it made of these has been sent
            handle.acknowledge()
            if isinstance(batch[-1], FinishEvent):
                return
    finally:
        if handle.finished is None:
            handle.cancel()


# ---------------------------------------------------------------------------------------------
# Text assembly
# ---------------------------------------------------------------------------------------------

#: C0 controls but tab and newline, DEL and the C1 controls: a model (the embedded one's random
#: weights above all) may sample them, and NUL or ESC sequences garble the client's terminal
CONTROL_CHARS = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])


def printable(text: str) -> str:
    """``text`` without control characters other than newline and tab."""
    return text.translate(CONTROL_CHARS)


class TextAssembler:
    """Generated ids to text: drops stop token ids and control characters (:func:`printable`:
    every text delta of both APIs comes from here), holds back text that may begin a stop
    string, and cuts the text at the first stop string (which is excluded, as the APIs do).
    ``token_ends[k]``: the text's length after the k-th pushed token."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_ids: set[int] | frozenset[int] = frozenset()):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.skip_ids = skip_ids
        self.text = ""
        self.emitted = 0
        self.stopped: str | None = None
        self.token_ends: list[int] = []

    def _hold(self) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def push(self, token_id: int) -> str:
        if self.stopped is not None or token_id in self.skip_ids:
            return ""
        self.text += printable(self.decoder.push(token_id))
        self.token_ends.append(len(self.text))
        return self._release(final=False)

    def tokens_until(self, offset: int) -> int:
        """How many pushed tokens it took to produce ``text[:offset]``."""
        for k, end in enumerate(self.token_ends):
            if end >= offset:
                return k + 1
        return len(self.token_ends)

    def reasoning_tokens(self, opens_thinking: bool) -> int:
        """Tokens spent in the reasoning block (up to and with its ``</think>``; all of them when
        it never closes); 0 when the prompt opened no reasoning block."""
        if not opens_thinking:
            return 0
        end = self.text.find(ReasoningSplitter.END)
        return self.tokens_until(end + len(ReasoningSplitter.END)) if end >= 0 else len(self.token_ends)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            cut = None
            for s in self.stop:
                i = self.text.find(s, start)
                if i >= 0 and (cut is None or i < cut):
                    cut, self.stopped = i, s
            if cut is not None:
                self.text = self.text[:cut]
                final = True
        end = len(self.text) if final else len(self.text) - self._hold()
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def finish(self) -> str:
        return self._release(final=True)


class ReasoningSplitter:
    """Splits generated text at ``</think>`` when the prompt opened a ``<think>`` block: text
    before it is reasoning, after it content (leading newlines dropped, as the template does when
    it re-renders the turn). Inactive: everything is content."""

    END = "</think>"

    def __init__(self, active: bool) -> None:
        self.in_reasoning = active
        self.buffer = ""
        self.content_started = False

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.buffer += text
        while self.buffer:
            if self.in_reasoning:
                i = self.buffer.find(self.END)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buffer[:i]))
                    self.buffer = self.buffer[i + len(self.END):]
                    self.in_reasoning = False
                    continue
                hold = 0 if final else next((k for k in range(min(len(self.END) - 1, len(self.buffer)), 0, -1)
                                             if self.buffer.endswith(self.END[:k])), 0)
                emit = self.buffer[:len(self.buffer) - hold]
                if emit:
                    out.append(("reasoning", emit))
                self.buffer = self.buffer[len(emit):]
                break
            if not self.content_started:
                stripped = self.buffer.lstrip("\n")
                if not stripped:
                    self.buffer = ""
                    break
                self.buffer = stripped
                self.content_started = True
            out.append(("content", self.buffer))
            self.buffer = ""
        return out


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes, for logprobs."""
    if hasattr(tokenizer, "decode_bytes"):
        raw = tokenizer.decode_bytes([token_id])
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


@dataclass(slots=True)
class Generation:
    """What one finished (or streamed) request produced."""

    token_events: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    finish: FinishEvent | None = None
    first_token_at: float | None = None
