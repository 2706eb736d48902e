"""FakeEngine: a minimal test double of hpc_cli.engine.engine.Engine for protocol-shape tests.

It speaks the engine contract (hpc_cli.engine.api, the Engine protocol) without a model: a worker thread emits an
AdmittedEvent, then deterministic tokens ("hello world " repeated, byte tokenizer), then a
FinishEvent with usage. Its "cache" remembers prompt prefixes at the tap hints it was given and
reports, as reuse, the longest remembered prefix of a new prompt (capped at n - 1). It is used
only to check the HTTP shapes; the live tests run the real engine.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from hpc_cli.engine.api import (AdmittedEvent, CacheStats, Engine, EngineStats, FinishEvent, FinishReason,
                                GenerationRequest, RequestCounts, RequestHandle, Residency, RunSettings, TokenEvent, Usage)
from hpc_cli.errors import UnavailableError
from hpc_cli.model.tokenizer import ByteTokenizer


@dataclass(slots=True, kw_only=True)
class FakeCacheStats(CacheStats):
    """The fake cache's stats: the figures every binding has plus its own sections, as a cache
    mode's binding adds them."""

    snapshots: int
    device: dict[str, int]


class FakeEngine(Engine):
    def __init__(self, text: str = "hello world ", token_delay: float = 0.0, max_model_len: int = 4096,
                 eos_after: int | None = None) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_name = "builtin:random"
        self.max_model_len = max_model_len
        self.text_ids = self.tokenizer.encode(text)
        self.token_delay = token_delay
        self.eos_after = eos_after
        self.snapshots: set[tuple[int, ...]] = set()
        self.submitted: list[RequestHandle] = []
        self.cancelled: set[str] = set()
        self.stopped = False
        self.saved: list = []
        self._queue: "queue.Queue[RequestHandle | None]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._active: list[RequestHandle] = []

    def start(self) -> "FakeEngine":
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self.stopped:
            raise UnavailableError("engine stopped")
        request.sampling.validate()
        handle = RequestHandle(request, self.cancel)
        with self._lock:
            self.submitted.append(handle)
            self._active.append(handle)
        self._queue.put(handle)
        return handle

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    def stop(self, timeout: float | None = None) -> None:
        self.stopped = True
        with self._lock:
            active = list(self._active)
        for h in active:
            self.cancelled.add("unavailable:" + h.request.request_id)
        self._queue.put(None)
        self._thread.join(timeout)

    def save_prefix_cache(self, path, abort=None) -> None:
        self.saved.append(path)

    def stats(self) -> EngineStats:
        with self._lock:
            running = len(self._active)
        cache = FakeCacheStats(mode="fake", pool={"cached": len(self.snapshots)}, pages=0, lanes_free=0,
                               host_slabs=0, slab_bytes=0, page_bytes=0, image_bytes=0, transfers_pending=0,
                               residency=Residency(entries=len(self.snapshots)), snapshots=len(self.snapshots),
                               device={"blocks": 3, "bytes": 1024})
        return EngineStats(model=self.model_name, kv_profile="bf16", max_concurrency=1, prefill_chunk=0, uptime_s=0.0,
                           requests=RequestCounts(running=running, waiting=0, prefilling=0),
                           counters={"requests": len(self.submitted)}, cache=cache, ttft_recent_s=[], fatal=None,
                           compilations=0, kernel_compilations={},
                           settings=RunSettings(kv_profile="bf16", speculative_backend="none", cache_mode="fake",
                                                profile_path=None))

    # worker ------------------------------------------------------------------------------------
    def _reuse(self, prompt: list[int]) -> int:
        best = 0
        for snap in self.snapshots:
            if len(snap) <= len(prompt) - 1 and len(snap) > best and tuple(prompt[:len(snap)]) == snap:
                best = len(snap)
        return best

    def _work(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                self._fail_all()
                return
            self._run(handle)

    def _fail_all(self) -> None:
        with self._lock:
            active, self._active = list(self._active), []
        for h in active:
            if h.finished is None:
                h.put(FinishEvent(FinishReason.UNAVAILABLE, Usage(prompt_tokens=len(h.request.prompt_tokens)),
                                  error="the server is stopping"))

    def _run(self, handle: RequestHandle) -> None:
        req = handle.request
        prompt = req.prompt_tokens
        sp = req.sampling
        reuse = self._reuse(prompt) if req.cache_enabled else 0
        handle.put(AdmittedEvent(reuse_tokens=reuse, cached_prefix_tokens=reuse))
        t0 = time.monotonic()
        usage = Usage(prompt_tokens=len(prompt), reuse_tokens=reuse, cached_prefix_tokens=reuse,
                      prefill_tokens=len(prompt) - reuse)
        text = ""
        reason = FinishReason.LENGTH
        for i in range(sp.max_tokens):
            if self.stopped or "unavailable:" + req.request_id in self.cancelled:
                with self._lock:
                    if handle in self._active:
                        self._active.remove(handle)
                handle.put(FinishEvent(FinishReason.UNAVAILABLE, usage, error="the server is stopping"))
                return
            if req.request_id in self.cancelled:
                reason = FinishReason.CANCELLED
                break
            if self.token_delay:
                time.sleep(self.token_delay)
            if self.eos_after is not None and i == self.eos_after and sp.stop_token_ids:
                tid = sp.stop_token_ids[0]
                handle.put(TokenEvent(tid, -0.1, [(tid, -0.1)] if sp.logprobs else None))
                usage.completion_tokens += 1
                reason = FinishReason.STOP
                break
            tid = self.text_ids[i % len(self.text_ids)]
            tops = [(tid, -0.25), (ord("x"), -2.0), (ord("y"), -3.0)][:sp.logprobs] if sp.logprobs else None
            handle.put(TokenEvent(tid, -0.25, tops))
            usage.completion_tokens += 1
            if usage.time_to_first_token is None:
                usage.time_to_first_token = time.monotonic() - t0
            text += chr(tid)
            if any(s in text for s in sp.stop):
                reason = FinishReason.STOP
                break
        if req.cache_enabled:
            for hint in req.tap_hints:
                self.snapshots.add(tuple(prompt[:hint.position]))
            self.snapshots.add(tuple(prompt[:len(prompt) - 1]))
        plps = [None] + [-1.5] * (len(prompt) - 1) if sp.prompt_logprobs else None
        with self._lock:
            if handle in self._active:
                self._active.remove(handle)
        handle.put(FinishEvent(reason, usage, prompt_logprobs=plps))
