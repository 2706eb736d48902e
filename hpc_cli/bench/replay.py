"""Replaying a trace against one cache mode: an in-process engine (:class:`EngineTarget`) or a
running server (:class:`HttpTarget`), the requests of a session in order, up to ``concurrency``
sessions at once, with the cache's residency sampled while it runs.

Every request is greedy with ``ignore_eos`` (the same output length in every mode). Measured per
request: the prompt tokens, the tokens the cache served (``cached_tokens``: usage.reuse_tokens),
the time to the first token from submission (in-process: the engine's own clock; over HTTP:
the first streamed delta) and the whole request's time.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from hpc_cli.bench.generate import TraceRequest
from hpc_cli.engine.api import FinishReason, Residency, to_json
from hpc_cli.errors import ConfigError, HpcError

if TYPE_CHECKING:
    import httpx

    from hpc_cli.engine.engine import Engine
    from hpc_cli.settings import ResolvedSettings


@dataclass(slots=True)
class RequestResult:
    id: str
    session: str
    index: int  # position in the trace
    sent_s: float  # since the run started
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ResidencySample:
    t_s: float
    device_kv_bytes: int
    device_state_bytes: int
    host_bytes: int
    entries: int

    @classmethod
    def of(cls, t: float, r: Residency) -> "ResidencySample":
        return cls(t, r.device_kv_bytes, r.device_state_bytes, r.host_bytes, r.entries)


@dataclass(slots=True)
class ModeRun:
    mode: str
    results: list[RequestResult] = field(default_factory=list)
    residency: list[ResidencySample] = field(default_factory=list)
    wall_s: float = 0.0
    setup_s: float = 0.0
    cache_stats: dict[str, object] = field(default_factory=dict)  # the binding's stats at the end


class Target(Protocol):
    """Where a trace is replayed: one request at a time per calling thread."""

    mode: str

    def send(self, request: TraceRequest, result: RequestResult) -> None: ...

    def residency(self) -> Residency: ...

    def cache_stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# An engine in this process
# ---------------------------------------------------------------------------------------------

class EngineTarget:
    """An engine built from ``resolved`` (its cache mode selected there), warmed up, rendering
    requests with the model's chat template as the server does (tap hints, message boundaries)."""

    def __init__(self, resolved: "ResolvedSettings", request_timeout_s: float = 600.0) -> None:
        from hpc_cli.engine.engine import Engine

        self.engine: "Engine" = Engine.from_settings(resolved)
        self.mode = self.engine.cache_mode.name
        self.timeout = request_timeout_s
        self.engine.start()
        self.engine.warmup()

    def send(self, request: TraceRequest, result: RequestResult) -> None:
        from hpc_cli.engine.api import GenerationRequest, SamplingParams
        from hpc_cli.server.chat import prepare_chat

        try:
            chat = prepare_chat(self.engine.tokenizer, request.messages, request.tools,
                                template_kwargs=request.chat_template_kwargs)
            req = GenerationRequest(chat.prompt_tokens,
                                    SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
                                    tap_hints=chat.tap_hints, message_boundaries=chat.message_boundaries,
                                    request_id=f"bench-{request.id}")
            t0 = time.perf_counter()
            toks, fin = self.engine.submit(req).result(timeout=self.timeout)
        except HpcError as exc:
            result.error = exc.message
            return
        result.total_s = time.perf_counter() - t0
        u = fin.usage
        result.prompt_tokens, result.cached_tokens = u.prompt_tokens, u.reuse_tokens
        result.completion_tokens, result.ttft_s = u.completion_tokens, u.time_to_first_token
        result.finish_reason = fin.reason
        if fin.reason == FinishReason.ERROR:
            result.error = fin.error

    def residency(self) -> Residency:
        st = self.engine.stats()
        return st.cache.residency if st is not None else Residency()

    def cache_stats(self) -> dict[str, object]:
        st = self.engine.stats()
        doc = to_json(st.cache) if st is not None else {}
        assert isinstance(doc, dict), "a cache's stats are an object"
        return doc

    def close(self) -> None:
        """Stop the engine and let its pools go before the next mode's engine sizes its own."""
        import gc

        import torch

        self.engine.stop()
        del self.engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# A running server
# ---------------------------------------------------------------------------------------------

class HttpTarget:
    """A server at ``base``: streaming /v1/chat/completions; residency from /v1/cache/stats."""

    def __init__(self, base: str, *, api_key: str | None = None, request_timeout_s: float = 600.0) -> None:
        import httpx

        self.base = base.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http: "httpx.Client" = httpx.Client(headers=headers, timeout=request_timeout_s)
        try:
            models = self.http.get(f"{self.base}/v1/models")
            models.raise_for_status()
            self.model = str(models.json()["data"][0]["id"])
            stats = self.http.get(f"{self.base}/v1/cache/stats").json()
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"no hpc-cli server answers at {self.base}: {exc}",
                              hint="start one with `hpc-cli serve`, or check --base (and the API key)") from None
        self.mode = str((stats.get("settings") or {}).get("cache_mode") or "server")

    def send(self, request: TraceRequest, result: RequestResult) -> None:
        import httpx

        body = {"model": self.model, "messages": request.messages, "max_tokens": request.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "chat_template_kwargs": request.chat_template_kwargs}
        if request.tools:
            body["tools"] = request.tools
        t0 = time.perf_counter()
        try:
            with self.http.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self._chunk(json.loads(line[6:]), time.perf_counter() - t0, result)
        except (httpx.HTTPError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.total_s = time.perf_counter() - t0

    @staticmethod
    def _chunk(chunk: dict, now: float, result: RequestResult) -> None:
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if result.ttft_s is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                result.ttft_s = now
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
                if result.ttft_s is None:
                    result.ttft_s = now

    def residency(self) -> Residency:
        r = (self.cache_stats().get("residency") or {})
        return Residency(**{k: int(v) for k, v in r.items()}) if isinstance(r, dict) else Residency()

    def cache_stats(self) -> dict[str, object]:
        import httpx

        try:
            doc = self.http.get(f"{self.base}/v1/cache/stats").json()
        except (httpx.HTTPError, ValueError):
            return {}
        return dict(doc.get("cache") or {})

    def close(self) -> None:
        self.http.close()


# ---------------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------------

def replay(target: Target, requests: Sequence[TraceRequest], *, concurrency: int = 1,
           sample_every_s: float = 0.25, on_done: Callable[[RequestResult], None] | None = None) -> ModeRun:
    """Send ``requests`` in trace order, a session's requests one after another, at most
    ``concurrency`` at once; sample the residency every ``sample_every_s`` and after each request."""
    run = ModeRun(target.mode)
    run.results = [RequestResult(r.id, r.session, i, 0.0) for i, r in enumerate(requests)]
    t0 = time.perf_counter()
    lock = threading.Condition()
    busy: set[str] = set()
    pending = list(range(len(requests)))
    stop = threading.Event()

    def sample() -> None:
        try:
            s = ResidencySample.of(time.perf_counter() - t0, target.residency())
        except Exception:  # noqa: BLE001 - a sample lost is no reason to stop the replay
            return
        with lock:
            run.residency.append(s)

    def sampler() -> None:
        while not stop.wait(sample_every_s):
            sample()

    def take() -> int | None:
        with lock:
            while True:
                if not pending:
                    return None
                for k, i in enumerate(pending):
                    if requests[i].session not in busy:
                        busy.add(requests[i].session)
                        del pending[k]
                        return i
                lock.wait()

    def worker() -> None:
        while (i := take()) is not None:
            res = run.results[i]
            res.sent_s = time.perf_counter() - t0
            target.send(requests[i], res)
            sample()
            with lock:
                busy.discard(requests[i].session)
                lock.notify_all()
            if on_done is not None:
                on_done(res)

    sample()
    th = threading.Thread(target=sampler, name="hpc-bench-sampler", daemon=True)
    th.start()
    workers = [threading.Thread(target=worker, name=f"hpc-bench-{k}", daemon=True)
               for k in range(max(1, concurrency))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    th.join()
    run.wall_s = time.perf_counter() - t0
    time.sleep(min(0.3, sample_every_s))  # the idle worker publishes its last stats
    sample()
    run.cache_stats = target.cache_stats()
    return run
