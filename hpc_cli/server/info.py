"""The routes that describe the server rather than generate: ``/health``, ``/metrics``
(Prometheus text or OpenMetrics, :mod:`.metrics`), ``/v1/cache/stats`` (the engine's stats JSON
with the snapshot table, made by its worker on request), ``/v1/models`` and SGLang's
``/get_server_info``.

``/health`` answers anyone (the model's name only with the key) and 503 with the reason once
the engine stopped after an error, while the server stops, or when the engine is not running.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from hpc_cli.engine.api import EngineStats, to_json
from hpc_cli.server.state import ServerState

log = logging.getLogger("hpc_cli.server")


def register(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

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
        body, content_type = state.metrics.exposition(engine_stats(state), request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        state.authorize(request)
        # the worker answers between two steps: wait for it off the event loop
        return JSONResponse(await run_in_threadpool(detailed_stats, state) or {})

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


def engine_stats(state: ServerState) -> dict | None:
    """The engine's published ``stats()`` as JSON (the HTTP edge: :func:`to_json`); None when
    there are none yet or taking them fails (logged)."""
    try:
        return _json(state.engine.stats())
    except Exception as exc:  # stats must never take /metrics down
        log.warning("engine.stats() failed: %s", exc)
        return None


def detailed_stats(state: ServerState) -> dict | None:
    """``engine.detailed_stats()`` (fresh, with the snapshot table); an engine without it
    serves its published stats."""
    detailed = getattr(state.engine, "detailed_stats", None)
    if detailed is None:
        return engine_stats(state)
    try:
        return _json(detailed())
    except Exception as exc:  # stats must never take the route down
        log.warning("engine.detailed_stats() failed: %s", exc)
        return engine_stats(state)


def _json(stats: EngineStats | None) -> dict | None:
    doc = to_json(stats)
    assert doc is None or isinstance(doc, dict), "the engine's stats are an object"
    return doc
