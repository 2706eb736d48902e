"""The FastAPI application: ``create_app(engine, settings)``.

The routes live one module each: :mod:`.info` (``/health``, ``/metrics``, ``/v1/cache/stats``,
``/v1/models``, ``/get_server_info``), :mod:`.chat_completions` and :mod:`.completions`
(OpenAI), :mod:`.messages` (Anthropic); their request bodies are :mod:`.schemas`, what they
share is :class:`.state.ServerState`, their streams are :mod:`.streaming` and their accounting
:mod:`.tracking`. Every ``/v1`` route (and ``/metrics`` with ``[server] protect_metrics``, on by
default with a key) requires ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` when an API key
is set. Errors come back in the API's own shape (this module's exception handlers): OpenAI
``{"error": {...}}``, Anthropic ``{"type": "error", ...}``. The limits on what one client may
make the server hold are :mod:`.limits`; request bodies are checked by :mod:`.validate`.
``/health`` answers 503 with the reason once the engine stopped after an error (and, with
``[server] exit_on_fatal``, the server stops; ``serve`` then exits with status 3).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpc_cli.engine.api import Engine
from hpc_cli.errors import EngineError, HpcError, OverloadedError, RequestError
from hpc_cli.server import chat_completions, completions, info, messages
from hpc_cli.server.common import ClientDisconnected, Unavailable, error_body
from hpc_cli.server.limits import RequestLimits
from hpc_cli.server.state import ServerState

if TYPE_CHECKING:
    from hpc_cli.server.stop import StopController
    from hpc_cli.settings.sections import HpcSettings, ResolvedSettings

log = logging.getLogger("hpc_cli.server")


def create_app(engine: Engine, settings: ResolvedSettings | HpcSettings,
               stop_controller: "StopController | None" = None) -> FastAPI:
    """The HTTP application over a started engine. ``settings``: ResolvedSettings or HpcSettings."""
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

    for route in (info, chat_completions, completions, messages):
        route.register(app, state)
    return app
