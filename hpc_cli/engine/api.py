"""What the engine takes and gives: requests, sampling parameters, output events, usage.

The server (and tests) talk to :class:`hpc_cli.engine.engine.Engine` only through these types
and the :class:`Engine` protocol: ``handle = engine.submit(GenerationRequest(...))`` returns a
:class:`RequestHandle` whose events (:class:`TokenEvent` per generated token, then one
:class:`FinishEvent`) arrive from the engine's worker thread; ``handle.cancel()`` stops it at
the next unit boundary.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

# re-exported: the server reads the engine through this module only (tests/test_layers.py)
from hpc_cli.engine.cache_path import check_cache_path as check_cache_path, remove_stale_temps as remove_stale_temps
from hpc_cli.engine.stats_types import CacheStats as CacheStats, EngineStats as EngineStats
from hpc_cli.engine.stats_types import RequestCounts as RequestCounts, Residency as Residency
from hpc_cli.engine.stats_types import RunSettings as RunSettings, to_json as to_json
from hpc_cli.errors import RequestError

if TYPE_CHECKING:
    import numpy as np

_ids = itertools.count(1)

#: a temperature below this samples as greedy (0): logits / t would overflow float32 and the
#: distribution is a one-hot anyway (vLLM draws the same line)
GREEDY_BELOW = 1e-5
#: the seeds a torch generator takes: [-2^63, 2^64)
SEED_MIN, SEED_END = -(1 << 63), 1 << 64


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt: its patches (``[t*h*w, patch_dim]`` float32, merge-block order),
    its grid (t, h, w) in patches, the sha256 ``digest`` of what the tower sees, and its
    placeholder span ``[begin, begin + length)`` in the prompt tokens (the server makes them,
    :mod:`hpc_cli.server.vision_prompt`; :mod:`hpc_cli.engine.media` feeds them to the model)."""

    pixels: "np.ndarray"
    grid: tuple[int, int, int]
    digest: bytes
    begin: int
    length: int

    @property
    def end(self) -> int:
        return self.begin + self.length


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
        """Check the values; a temperature below :data:`GREEDY_BELOW` becomes 0 (greedy)."""
        if self.max_tokens < 0:
            raise RequestError("max_tokens must be >= 0", param="max_tokens")
        if not (0.0 <= self.temperature <= 100.0):
            raise RequestError("temperature must be between 0 and 100", param="temperature")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if self.seed is not None and not (SEED_MIN <= self.seed < SEED_END):
            raise RequestError(f"seed must be in [-2^63, 2^64), got {self.seed}", param="seed")
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
    cache_salt: str | None = None  # a tenant's salt: its cache entries are its own (docs/security.md)
    media: list["PromptImage"] = field(default_factory=list)  # the prompt's images (docs/vision.md)


# The phases of a request, in order; each is a disjoint stretch of its wall time (RequestTiming).
PHASES = ("admission", "restore_wait", "prefill", "tap", "decode", "finish")


@dataclass(frozen=True, slots=True)
class PrefillPass:
    seconds: float  # the pass's host time less its restore wait and taps
    tokens: int


@dataclass(slots=True)
class RequestTiming:
    """Where one request's time went: host wall-clock seconds on the engine's worker thread
    (``time.perf_counter`` at a few points; admission from the handle's monotonic submit time).

    The phases are disjoint stretches of the request's life, so they add up to no more than its
    wall time (the rest is waiting for other lanes' work, sampling outside passes, the server):
    ``admission`` submit until the lane is admitted (queue wait, quote, restore submission);
    ``restore_wait`` the first prefill pass's waits on the restore's per-layer events;
    ``prefill`` each pass less its restore wait and taps (:attr:`passes`; the last pass includes
    sampling the first token); ``tap`` the tap calls around passes that took snapshot copies
    (:attr:`taps` of them; the block commits of such a call included; the last pass's, which
    run during the first decode step, are not counted in ``decode``); ``decode`` from the end of
    the pass that sampled the first token to the last token; ``finish`` the finish call
    (endpoint snapshot, release, write-through submission).

    Nothing here synchronises the device. On CUDA the host does not wait for kernels it
    launches, so a phase is the host time the worker spent in it, which is what the user feels:
    device work shows where the host already waits (reading a sampled token), and a restore wait
    is the compute stream waiting on an event, near zero on the host."""

    admission: float = 0.0
    restore_wait: float = 0.0
    passes: list[PrefillPass] = field(default_factory=list)
    taps: int = 0
    tap: float = 0.0
    tap_in_decode: float = 0.0  # the part of ``tap`` spent after decode_from (the last pass's taps)
    finish: float = 0.0
    decode_from: float | None = None  # perf_counter at the end of the pass that sampled the first token
    last_token_at: float | None = None  # perf_counter at the last token

    @property
    def prefill(self) -> float:
        return sum(p.seconds for p in self.passes)

    @property
    def decode(self) -> float:
        if self.decode_from is None or self.last_token_at is None:
            return 0.0
        return max(0.0, self.last_token_at - self.decode_from - self.tap_in_decode)

    def phases(self) -> dict[str, float]:
        """Seconds per phase, every one of :data:`PHASES`."""
        return {"admission": self.admission, "restore_wait": self.restore_wait, "prefill": self.prefill,
                "tap": self.tap, "decode": self.decode, "finish": self.finish}

    def timed_wait(self, wait: Callable[[int], None]) -> Callable[[int], None]:
        """``wait`` (a restore ticket's per-layer wait) adding its host time to ``restore_wait``."""

        def timed(layer: int) -> None:
            t0 = time.perf_counter()
            wait(layer)
            self.restore_wait += time.perf_counter() - t0

        return timed

    def add_taps(self, seconds: float, snapshots: int) -> float:
        """Count a tap call that took ``snapshots`` copies; returns the seconds charged to taps."""
        if snapshots <= 0:
            return 0.0
        self.taps += snapshots
        self.tap += seconds
        return seconds


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
    timing: RequestTiming = field(default_factory=RequestTiming)  # phase seconds (RequestTiming)


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class FinishReason(StrEnum):
    """Why a request ended (a ``str``: it compares, formats and serialises as its value)."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens (or the context) reached
    CANCELLED = "cancelled"  # the client cancelled it
    ERROR = "error"  # it failed in the engine (alone, or the engine stopped after an error)
    UNAVAILABLE = "unavailable"  # the server is stopping


@dataclass(slots=True)
class FinishEvent:
    reason: FinishReason
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
    """The caller's side of one request: iterate events, or cancel.

    A consumer that sends the events on (the server) may acknowledge them: :meth:`acknowledge`
    says that every event taken so far has left the process (``acknowledges`` is then True).
    The engine waits a moment for that after emitting a first or last token and before its host
    work that delays nothing on the device (:meth:`wait_sent`), so the server's event loop has
    the interpreter to itself while it sends them."""

    def __init__(self, request: GenerationRequest, cancel_fn) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self._events: "queue.SimpleQueue[Event]" = queue.SimpleQueue()
        self._cancel_fn = cancel_fn
        self.cancelled = threading.Event()
        self.finished: FinishEvent | None = None
        self.acknowledges = False  # set by a consumer that calls acknowledge()
        # events put, taken, and taken and sent on: counts, so that neither side takes a lock a
        # token (a waiting engine is woken through ``_waiter``, made only while it waits)
        self._put = 0
        self._taken = 0
        self._acked = 0
        self._waiter: threading.Event | None = None

    # engine side
    def put(self, event: Event) -> None:
        self._put += 1
        self._events.put(event)

    def wait_sent(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the consumer to have sent every event put so far; False at
        once for a consumer that does not acknowledge."""
        if not self.acknowledges:
            return False
        if self._acked >= self._put:
            return True
        self._waiter = waiter = threading.Event()
        try:  # (acknowledge counts first and looks for a waiter after: one of the two sees the other)
            return self._acked >= self._put or waiter.wait(timeout)
        finally:
            self._waiter = None

    # consumer side
    def acknowledge(self) -> None:
        """Every event taken so far has been sent on (a consumer that calls this sets
        ``acknowledges`` first)."""
        self._acked = self._taken
        waiter = self._waiter
        if waiter is not None and self._acked >= self._put:  # an event put meanwhile keeps it waiting
            waiter.set()

    # caller side
    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._cancel_fn(self.request.request_id)

    def get(self, timeout: float | None = None) -> Event:
        ev = self._events.get(timeout=timeout)
        self._taken += 1
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


class HostTier(Protocol):
    """What the server reads of the engine's host tier (``engine.cache.host``, a
    :class:`~hpc_cli.memory.host_slabs.HostSlabStorage`): whether its first chunk could be
    allocated before it serves."""

    num_slabs: int
    slabs_per_chunk: int
    ready_slabs: int
    error: str | None

    def wait_ready(self, slabs: int, timeout: float | None = None) -> int: ...


class Engine(Protocol):
    """What the server needs of an engine (:class:`hpc_cli.engine.engine.Engine`; the tests'
    ``FakeEngine``): a tokenizer, the model's name and context length, ``submit``, ``stop`` and
    the published ``stats()`` (an :class:`EngineStats`, JSON by :func:`to_json` at the edge).

    The server also reads, where an engine has them (``getattr`` with a default, so a small
    engine may leave them out): ``fatal`` (why the worker stopped after an error, else None),
    ``running`` (bool), ``in_flight`` (requests submitted and not finished), ``C`` (lanes),
    ``on_fatal`` (callbacks the worker runs once it stopped on an error), ``detailed_stats()``
    (``stats()`` made fresh by the worker, with the snapshot table), ``save_prefix_cache(path,
    abort)`` and ``model`` (its ``vision`` tower, ``image_processor`` and ``multimodal`` config
    for images).
    """

    tokenizer: Any
    model_name: str
    max_model_len: int

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def stop(self, timeout: float | None = ...) -> None: ...

    def stats(self) -> EngineStats | None: ...
