"""The FastAPI application: ``create_app(engine, settings)``.

Routes: ``/health``, ``/metrics`` (Prometheus text or OpenMetrics, :mod:`.metrics`),
``/v1/cache/stats`` (the engine's stats JSON with the snapshot table, made by its worker on
request), ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (OpenAI, :mod:`.openai`) and ``/v1/messages`` (Anthropic,
:mod:`.anthropic`). Every ``/v1`` route (and ``/metrics`` with ``[server] protect_metrics``,
on by default with a key) requires ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` when an
API key is set. Errors come back in the API's own shape: OpenAI ``{"error": {...}}``, Anthropic
``{"type": "error", ...}``. The limits on what one client may make the server hold are
:mod:`.limits`; request bodies are checked by :mod:`.validate`. ``/health`` answers 503 with the
reason once the engine stopped after an error (and, with ``[server] exit_on_fatal``, the server
stops; ``serve`` then exits with status 3).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpc_cli.engine.api import GenerationRequest, RequestHandle
from hpc_cli.errors import EngineError, HpcError, OverloadedError, RequestError, UnavailableError
from hpc_cli.server.common import ClientDisconnected, Unavailable, error_body, is_anthropic_path
from hpc_cli.server.limits import AdmissionGate, RequestLimits
from hpc_cli.server.metrics import Metrics, add_engine_fatal_gauge
from hpc_cli.server.validate import echo

log = logging.getLogger("hpc_cli.server")


class ServerState:
    """What the routes share: the engine, settings, metrics and the admission switch."""

    def __init__(self, engine: Any, settings: Any) -> None:
        hs = getattr(settings, "settings", settings)  # ResolvedSettings or HpcSettings
        self.engine = engine
        self.settings = hs
        self.resolved = settings if hs is not settings else None
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


def create_app(engine: Any, settings: Any, stop_controller: Any = None) -> FastAPI:
    """The HTTP application over a started engine. ``settings``: ResolvedSettings or HpcSettings."""
    from hpc_cli.server import anthropic, openai

    app = FastAPI(title="hpc-cli", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(engine, settings)
    app.state.hpc = state
    app.state.stop_controller = stop_controller
    server_settings = state.settings.server
    app.add_middleware(RequestLimits, max_body_bytes=server_settings.max_request_bytes,
                       body_timeout_s=server_settings.body_timeout_s)
    if stop_controller is not None and hasattr(engine, "on_fatal"):
        engine.on_fatal.append(lambda _engine: stop_controller.engine_failed(state.engine_fatal() or "unknown"))

    def shaped(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, status, message, param, code), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return shaped(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable):
        return shaped(request, 503, exc.message, code="unavailable")

    @app.exception_handler(OverloadedError)
    async def _overloaded(request: Request, exc: OverloadedError):
        return shaped(request, 429, exc.message, code=exc.code, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        return shaped(request, 500, exc.message + (f" ({exc.hint})" if exc.hint else ""), code="engine_error")

    @app.exception_handler(HpcError)
    async def _hpc_error(request: Request, exc: HpcError):
        msg = exc.message + (f" ({exc.hint})" if exc.hint else "")
        return shaped(request, 400, msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return shaped(request, exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return shaped(request, 400, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return shaped(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health(request: Request):
        fatal = state.engine_fatal()
        if fatal:
            return JSONResponse({"status": "error", "reason": f"the engine stopped after an error: {fatal}"},
                                status_code=503)
        if not state.accepting:
            return JSONResponse({"status": "stopping"}, status_code=503)
        running = getattr(engine, "running", True)
        if not running:
            return JSONResponse({"status": "error", "reason": "the engine is not running"}, status_code=503)
        # liveness answers anyone; which model is served, only those with the key
        return {"status": "ok", "model": state.served_name} if state.is_authorized(request) else {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        if state.protect_metrics:
            state.authorize(request)
        body, content_type = state.metrics.exposition(_engine_stats(state), request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        state.authorize(request)
        # the worker answers between two steps: wait for it off the event loop
        return JSONResponse(await run_in_threadpool(_detailed_stats, state) or {})

    @app.get("/v1/models")
    async def models(request: Request):
        state.authorize(request)
        return {"object": "list", "data": [{
            "id": state.served_name, "object": "model", "created": int(state.started), "owned_by": "hpc-cli",
            "root": state.model_name, "max_model_len": state.max_model_len}]}

    @app.get("/get_server_info")
    async def server_info(request: Request):
        # SGLang's route: sglang-router learns a worker's model from it (hpc-cli cluster up)
        state.authorize(request)
        return {"served_model_name": state.served_name, "is_generation": True,
                "max_context_length": state.max_model_len}

    openai.register(app, state)
    anthropic.register(app, state)
    return app


def _engine_stats(state: ServerState) -> dict | None:
    try:
        return state.engine.stats()
    except Exception as exc:  # stats must never take /metrics down
        log.warning("engine.stats() failed: %s", exc)
        return None


def _detailed_stats(state: ServerState) -> dict | None:
    """``engine.detailed_stats()`` (fresh, with the snapshot table); an engine without it
    serves its published stats."""
    detailed = getattr(state.engine, "detailed_stats", None)
    if detailed is None:
        return _engine_stats(state)
    try:
        return detailed()
    except Exception as exc:  # stats must never take the route down
        log.warning("engine.detailed_stats() failed: %s", exc)
        return _engine_stats(state)
