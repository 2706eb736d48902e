"""Shared pieces of the hostile-input tests (issue 21): the real engine (builtin:random on CPU)
behind live servers on 127.0.0.1 that run with serve's own connection limits
(:func:`hpc_cli.server.limits.uvicorn_config`), raw-socket helpers, and the leak probe."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import httpx

from hpc_cli.engine.engine import Engine
from hpc_cli.server.app import create_app
from hpc_cli.server.limits import uvicorn_config
from hpc_cli.settings import ResolvedSettings, load_settings

MODEL = "builtin:random"
ENGINE_FLAGS = {"model.name": MODEL, "model.device": "cpu", "model.max_model_len": 512,
                "engine.max_concurrency": 2, "engine.prefill_chunk": 128, "engine.default_max_tokens": 4,
                "cache.host_cache_mib": 16}
NO_THINK = {"enable_thinking": False}


def settings(**flags: object) -> ResolvedSettings:
    return load_settings(None, {**ENGINE_FLAGS, **flags}, environ={})


def start_engine(**flags: object) -> tuple[Engine, ResolvedSettings]:
    s = settings(**flags)
    return Engine.from_settings(s).start(), s


@dataclass
class Live:
    url: str
    server: object  # uvicorn.Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def live(app, resolved: ResolvedSettings, stop_controller=None) -> Iterator[Live]:
    """Serve ``app`` on a free loopback port with serve's connection limits."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(app, resolved.settings.server, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    if stop_controller is not None:
        stop_controller.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "uvicorn did not start within 20 s"
    try:
        yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def served(engine: Engine, resolved: ResolvedSettings, stop_controller=None) -> Iterator[Live]:
    app = create_app(engine, resolved, stop_controller=stop_controller)
    if stop_controller is not None:
        stop_controller.state = app.state.hpc
    with live(app, resolved, stop_controller) as srv:
        srv.app = app
        yield srv


def chat_body(content: str = "Say something.", **extra: object) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, "chat_template_kwargs": NO_THINK}
    body.update(extra)
    return body


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Until the engine holds no request (every cancellation landed)."""
    deadline = time.monotonic() + timeout
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.in_flight == 0, f"{engine.in_flight} requests still in the engine after {timeout} s"


def leaks(engine: Engine) -> list[str]:
    """What an idle engine should not hold (checked on its worker between two steps, once the
    transfers it queued have landed): the cache invariants, live sequences, pinned blocks or
    snapshots, busy lanes, active pages. (The last request's write-through is queued in the step
    that finished it and lands in the worker's next poll; a probe that runs between the two sees
    its pins, which are no leak.)"""

    def probe() -> list[str]:
        engine.cache.drain()
        engine.check_invariants()
        cache = engine.cache
        index = cache.index
        out = []
        if index.sequences:
            out.append(f"{len(index.sequences)} live sequences")
        pinned = [n for n in index.tree.walk() if n.pinned]
        if pinned:
            out.append(f"{len(pinned)} pinned blocks")
        snaps = [s for s in index.snapshots.values() if getattr(s, "restore_pins", 0)] \
            if isinstance(index.snapshots, dict) else []
        if snaps:
            out.append(f"{len(snaps)} pinned snapshots")
        if len(cache.free_active) != engine.C:
            out.append(f"{engine.C - len(cache.free_active)} active state slots held")
        if engine._lanes or engine._waiting:
            out.append(f"{len(engine._lanes)} lanes, {len(engine._waiting)} waiting")
        return out

    return engine.call(probe, timeout=30)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)"
    m = re.search(r"^" + pattern + r"$", text, re.M)
    return float(m.group(1)) if m else 0.0


def raw_connect(url: str, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    return s


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``timeout``), and the seconds it took."""
    sock.settimeout(timeout)
    t0 = time.monotonic()
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data, time.monotonic() - t0


def client(url: str, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, timeout=timeout, headers=headers, trust_env=False)
