"""What the engine takes and gives: requests, sampling parameters, output events, usage.

The server (and tests) talk to :class:`hpc_cli.engine.engine.Engine` only through these types:
``handle = engine.submit(GenerationRequest(...))`` returns a :class:`RequestHandle` whose events
(:class:`TokenEvent` per generated token, then one :class:`FinishEvent`) arrive from the engine's
worker thread; ``handle.cancel()`` stops it at the next unit boundary.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from hpc_cli.errors import RequestError

_ids = itertools.count(1)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (excluded from text)
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the text contains one (excluded)
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the chosen token's)
    prompt_logprobs: bool = False  # logprob of every prompt token given its prefix (completions echo);
    # such a request prefills from the root (reused positions have no logits) but still caches
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 0:
            raise RequestError("max_tokens must be >= 0", param="max_tokens")
        if not (0.0 <= self.temperature <= 100.0):
            raise RequestError("temperature must be between 0 and 100", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0", param="top_k")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise RequestError("logprobs must be between 0 and 20", param="logprobs")


@dataclass(frozen=True, slots=True)
class TapHint:
    """A position where a snapshot is worth taking (spec §7.1): priority 1 explicit (client
    breakpoint), 2 generation opener, 3 structural (end of tools / leading system block);
    ``automatic`` marks protocol-automatic markers, planned as structural."""

    position: int
    priority: int
    automatic: bool = False


@dataclass(slots=True)
class GenerationRequest:
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tap_hints: list[TapHint] = field(default_factory=list)
    message_boundaries: list[int] = field(default_factory=list)  # ladder snapping (spec §7.1 priority 5)
    cache_enabled: bool = True  # False: a disabled request leaves nothing behind (spec §7.7)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reuse_tokens: int = 0  # the frontier the request resumed from: reported as cached_tokens
    cached_prefix_tokens: int = 0  # longest cached block prefix, reusable or not
    restored_host_bytes: int = 0
    prefill_tokens: int = 0  # tokens actually prefilled (prompt - reuse)
    time_to_first_token: float | None = None  # seconds from submit to the first token
    queue_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" | "error" | "unavailable"
    usage: Usage
    error: str | None = None
    stop_text: str | None = None  # the stop string that ended it, if any
    prompt_logprobs: list[float | None] | None = None  # entry i: log p(prompt[i] | prompt[:i]); entry 0 None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # top-N per prompt position


@dataclass(slots=True)
class AdmittedEvent:
    """Sent once when the request is admitted: its reuse is fixed here (spec §8.3)."""

    reuse_tokens: int
    cached_prefix_tokens: int


Event = TokenEvent | FinishEvent | AdmittedEvent


class RequestHandle:
    """The caller's side of one request: iterate events, or cancel."""

    def __init__(self, request: GenerationRequest, cancel_fn) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self._events: "queue.Queue[Event]" = queue.Queue()
        self._cancel_fn = cancel_fn
        self.cancelled = threading.Event()
        self.finished: FinishEvent | None = None

    # engine side
    def put(self, event: Event) -> None:
        self._events.put(event)

    # caller side
    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._cancel_fn(self.request.request_id)

    def get(self, timeout: float | None = None) -> Event:
        ev = self._events.get(timeout=timeout)
        if isinstance(ev, FinishEvent):
            self.finished = ev
        return ev

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        while True:
            ev = self.get(timeout=timeout)
            yield ev
            if isinstance(ev, FinishEvent):
                return

    def result(self, timeout: float | None = None) -> tuple[list[TokenEvent], FinishEvent]:
        tokens: list[TokenEvent] = []
        for ev in self.events(timeout=timeout):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            elif isinstance(ev, FinishEvent):
                return tokens, ev
        raise AssertionError("event stream ended without a FinishEvent")
