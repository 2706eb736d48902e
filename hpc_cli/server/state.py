"""What the routes share: :class:`ServerState`, the engine (:class:`hpc_cli.engine.api.Engine`),
the settings, the metrics and the admission switch, with the checks every route makes
(authorization, the model name, the token budget) and the one way requests reach the engine
(:meth:`ServerState.submit`).
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Callable, ParamSpec, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from hpc_cli.engine.api import Engine, GenerationRequest, RequestHandle
from hpc_cli.errors import RequestError, UnavailableError
from hpc_cli.server.common import Unavailable
from hpc_cli.server.limits import AdmissionGate
from hpc_cli.server.metrics import Metrics, add_engine_fatal_gauge
from hpc_cli.server.validate import THREAD_BYTES, echo, read_model
from hpc_cli.settings.sections import HpcSettings, ResolvedSettings

Body = TypeVar("Body", bound=BaseModel)
P = ParamSpec("P")
R = TypeVar("R")


class ServerState:
    """What the routes share: the engine, settings, metrics and the admission switch."""

    def __init__(self, engine: Engine, settings: ResolvedSettings | HpcSettings) -> None:
        self.resolved = settings if isinstance(settings, ResolvedSettings) else None
        hs = self.resolved.settings if self.resolved is not None else settings
        self.engine = engine
        self.settings = hs
        self.metrics = Metrics()
        self.accepting = True
        self.started = time.time()
        self.tokenizer = engine.tokenizer
        self.model_name: str = str(getattr(engine, "model_name", None) or hs.model.name)
        self.served_name: str = hs.server.served_model_name or self.model_name
        self.max_model_len: int = int(getattr(engine, "max_model_len", None) or hs.model.max_model_len or 32768)
        key = hs.server.api_key
        self.api_key: str | None = key.get_secret_value() if key is not None else None
        self.default_max_tokens: int = hs.engine.default_max_tokens
        self.cache_enabled: bool = not hs.cache.no_prefix_reuse and hs.cache.mode != "off"
        protect = hs.server.protect_metrics
        self.protect_metrics: bool = bool(self.api_key) if protect is None else (protect and bool(self.api_key))
        lanes = int(getattr(engine, "C", None) or hs.engine.max_concurrency)
        self.gate = AdmissionGate(lanes, hs.server.max_fanout, hs.server.max_queued_requests,
                                  lambda: int(getattr(engine, "in_flight", 0)))
        self.fatal_gauge = add_engine_fatal_gauge(self.metrics, self.engine_fatal)

    async def prepare(self, request: Request, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A request's preparation (the chat template and the tokenizer, linear in its messages):
        on the event loop when the engine has nothing in flight and the body is smaller than
        :data:`~hpc_cli.server.validate.THREAD_BYTES` (the size below which bodies are parsed
        there too), where no stream waits on the loop and the thread pool's two hops (about 0.3
        ms of a cached turn's first token on an H100 host) are saved; on the thread pool
        otherwise, so running requests' streams and a large prompt's neighbours keep flowing."""
        if not self.gate.in_flight() and len(await request.body()) < THREAD_BYTES:
            return fn(*args, **kwargs)
        return await run_in_threadpool(fn, *args, **kwargs)

    # --- checks --------------------------------------------------------------------------------
    def is_authorized(self, request: Request) -> bool:
        """No API key set, or one of ``Authorization: Bearer KEY`` and ``x-api-key: KEY`` carries
        it (both accepted on every protected route; compared in constant time)."""
        if not self.api_key:
            return True
        expected = self.api_key.encode()
        given = []
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        given.append(request.headers.get("x-api-key", ""))
        return any(key and hmac.compare_digest(key.encode(), expected) for key in given)

    def authorize(self, request: Request) -> None:
        if not self.is_authorized(request):
            raise RequestError("invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                               status=401, code="invalid_api_key")

    async def read_body(self, request: Request, model_cls: type[Body]) -> Body:
        """The request authorized and its body read as ``model_cls`` (a 400 when it is not one)."""
        self.authorize(request)
        return await read_model(request, model_cls)

    def engine_fatal(self) -> str | None:
        """Why the engine stopped after an error (None while it works)."""
        fatal = getattr(self.engine, "fatal", None)
        return str(fatal) if fatal else None

    def check_model(self, name: Any) -> str:
        if name in (self.served_name, self.model_name):
            return self.served_name
        raise RequestError(f"The model `{echo(name)}` does not exist (this server serves `{self.served_name}`)",
                           status=404, param="model", code="model_not_found")

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, default: int | None = None,
                           prompt_param: str = "messages") -> int:
        """``prompt_param``: the request field that holds the prompt (``prompt`` on /v1/completions)."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"has {prompt_len} tokens. Please reduce the length of the prompt.",
                               param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return min(default if default is not None else self.default_max_tokens, limit - prompt_len)
        if prompt_len + requested > limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                               "completion). Please reduce the length of the prompt or the completion.",
                               param="max_tokens", code="context_length_exceeded")
        return requested

    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(int(i) for i in getattr(self.tokenizer, "eos_token_ids", ()) or ())

    # --- engine --------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not self.accepting:
            raise Unavailable()
        fatal = self.engine_fatal()
        if fatal:
            raise Unavailable(f"the engine stopped after an error: {fatal}; the server must be restarted")
        self.gate.check_room(1)
        request.sampling.validate()
        if not self.cache_enabled:
            request.cache_enabled = False
        try:
            return self.engine.submit(request)
        except UnavailableError as exc:
            raise Unavailable(exc.message) from None

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Submit each request; when one is refused, the ones already submitted are cancelled."""
        handles: list[RequestHandle] = []
        for req in requests:
            try:
                handles.append(self.submit(req))
            except BaseException:
                for h in handles:
                    h.cancel()
                raise
        return handles
