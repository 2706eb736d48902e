"""Bounds on what one client can make the server hold (``[server]`` settings).

- :class:`RequestLimits`, an ASGI middleware: a request body larger than ``max_request_bytes``
  gets 413 (at once when its Content-Length says so, else as soon as the bytes read pass it), and
  a body that does not arrive within ``body_timeout_s`` of the request head gets 408.
- :func:`event_loop`: the loop ``[server] event_loop`` names (uvloop where installed).
- :func:`guarded_h11`: uvicorn's h11 protocol with a deadline for the request head
  (``header_timeout_s``; uvicorn itself waits for a started head forever), which also bounds
  how long the rest of a body the app answered without reading (a 401, a 413) may take to
  arrive. Header size is bounded by h11 (16 KiB), idle keep-alive connections by
  ``keep_alive_timeout_s``.
- :class:`AdmissionGate`: the fan-out of one HTTP request (``n`` x prompts) is at most
  ``max_fanout`` (400), and the engine requests submitted and not finished at most the engine's
  lanes plus ``max_queued_requests`` (429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import importlib
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hpc_cli.errors import ConfigError, OverloadedError, RequestError
from hpc_cli.server.common import error_body

if TYPE_CHECKING:
    import uvicorn

    from hpc_cli.settings import ServerSettings

MiB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MiB:.3g} MiB" if n >= MiB else f"{n} B"


# ---------------------------------------------------------------------------------------------
# Request bodies: size and read deadline
# ---------------------------------------------------------------------------------------------

def too_large(max_bytes: int) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit of {_mib(max_bytes)}",
                        hint="send a smaller request ([server] max_request_bytes sets the limit)",
                        status=413, code="request_too_large")


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length header as a number; -1 when it is not one."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) <= 20 else -1
    return None


@dataclass(slots=True)
class _BodyReader:
    """The app's ``receive``: counts body bytes and enforces the deadline until the body ends."""

    receive: Receive
    max_bytes: int
    deadline: float
    timeout_s: float
    received: int = 0
    complete: bool = False

    async def __call__(self) -> Message:
        if self.complete:
            return await self.receive()
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            if left <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(self.receive(), left)
        except (TimeoutError, asyncio.TimeoutError):
            raise RequestError(f"the request body did not arrive within {self.timeout_s:g} s",
                               hint="send the whole body promptly ([server] body_timeout_s)",
                               status=408, code="request_timeout") from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_bytes:
                raise too_large(self.max_bytes)
            self.complete = not message.get("more_body", False)
        else:
            self.complete = True  # http.disconnect: nothing more will come
        return message


class RequestLimits:
    """ASGI middleware: the body size limit and the body read deadline (see the module doc)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and (declared < 0 or declared > self.max_body_bytes):
            err = too_large(self.max_body_bytes) if declared > 0 else RequestError(
                "the Content-Length header is not a number", code="invalid_request")
            path = scope.get("path", "")
            message = err.message + (f" ({err.hint})" if err.hint else "")
            response = JSONResponse(error_body(path, err.status, message, code=err.code), status_code=err.status,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        await self.app(scope, _BodyReader(receive, self.max_body_bytes, deadline, self.body_timeout_s), send)


# ---------------------------------------------------------------------------------------------
# The connection: request-head deadline, unread bodies
# ---------------------------------------------------------------------------------------------

class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module doc).

    The deadline is armed when the connection opens and when a response completes: by then the
    next request's head must have arrived, and with it the rest of a body the app answered
    without reading (a 401, a 413: uvicorn drains and drops it, but would wait for it forever).
    A new request cycle disarms it; the cycle itself has no deadline here (the body has
    :class:`RequestLimits`, a response takes what it takes)."""

    header_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _armed_for: object = None  # the cycle (None before the first) the deadline was armed after

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._armed_for:
            self._cancel_head_timer()  # a new request head arrived

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # may start a pipelined request's cycle at once
        if self.cycle is finished and not self.transport.is_closing():
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._armed_for = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._armed_for and not self.transport.is_closing():
            self.transport.close()


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on the connection: asyncio sets it only on sockets it created with the TCP
    protocol number, not on connections accepted from a socket bound by hand (``serve`` binds
    its own), and without it every keep-alive response waits ~40 ms for a delayed ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """The h11 protocol class for uvicorn's ``http=`` with this request-head deadline."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})


def event_loop(setting: str) -> str:
    """The event loop ``[server] event_loop`` names: ``uvloop`` or ``asyncio`` (``auto``: uvloop
    where it imports). uvloop runs the server's own Python in fewer steps: a bare app with this
    server's connection settings answering a streamed 23 KiB chat request to the openai client,
    3.45 ms against 4.05 ms p50 on an H100 machine's host (``benchmarks/http_floor.py``,
    docs/server.md). Asked for by name where it is not installed: a ConfigError with a hint."""
    if setting == "asyncio":
        return "asyncio"
    try:
        importlib.import_module("uvloop")
    except ImportError:
        if setting == "uvloop":
            raise ConfigError("server.event_loop is 'uvloop' but uvloop is not installed",
                              hint="pip install uvloop, or set server.event_loop = 'auto' or 'asyncio'") from None
        return "asyncio"
    return "uvloop"


def uvicorn_config(app: ASGIApp, server: "ServerSettings", **kwargs: object) -> "uvicorn.Config":
    """A uvicorn config with this server's connection limits (h11, head deadline, keep-alive) on
    the event loop it names (:func:`event_loop`)."""
    import uvicorn

    kwargs.setdefault("host", server.host)
    kwargs.setdefault("port", server.port)
    if "loop" not in kwargs:  # (run_server resolves it before the model loads and passes it)
        kwargs["loop"] = event_loop(server.event_loop)
    return uvicorn.Config(app, http=guarded_h11(server.header_timeout_s),
                          timeout_keep_alive=max(1, round(server.keep_alive_timeout_s)), **kwargs)


# ---------------------------------------------------------------------------------------------
# Fan-out and the queue bound
# ---------------------------------------------------------------------------------------------

class AdmissionGate:
    """The fan-out limit and the queue bound. ``in_flight()`` is the engine's count of requests
    submitted and not finished (read on the event loop, where every submission happens, so a
    request's own submissions count before its next check)."""

    RETRY_AFTER_S = 1

    def __init__(self, lanes: int, max_fanout: int, max_queued: int, in_flight: Callable[[], int]) -> None:
        self.lanes = lanes
        self.max_fanout = max_fanout
        self.max_queued = max_queued
        self.in_flight = in_flight

    @property
    def capacity(self) -> int:
        return self.lanes + self.max_queued

    def check_fanout(self, count: int, param: str = "n") -> None:
        """Refuse a request that would make more than ``max_fanout`` engine requests (400)."""
        if count > self.max_fanout:
            raise RequestError(f"this request would run {count} generations (n times the prompts); this server "
                               f"allows at most {self.max_fanout} per request",
                               hint="split it into several requests ([server] max_fanout)", param=param,
                               code="too_many_generations")

    def check_room(self, count: int = 1) -> None:
        """Refuse ``count`` more engine requests when the queue cannot take them (429)."""
        busy = self.in_flight()
        if busy + count > self.capacity:
            raise OverloadedError(f"the server's queue is full ({busy} requests in flight, room for "
                                  f"{self.capacity}); retry shortly",
                                  hint="retry after the Retry-After seconds ([server] max_queued_requests)",
                                  retry_after_s=self.RETRY_AFTER_S)

    def check(self, count: int, param: str = "n") -> None:
        self.check_fanout(count, param)
        self.check_room(count)
