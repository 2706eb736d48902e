"""Live servers for the server tests: uvicorn on 127.0.0.1 (a free port) in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest


@contextlib.contextmanager
def live_server(app, stop_controller=None):
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL; stops the server after."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
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
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def serve():
    """serve(app) -> base URL; everything started is stopped at teardown."""
    stack = contextlib.ExitStack()

    def start(app, stop_controller=None):
        return stack.enter_context(live_server(app, stop_controller))

    with stack:
        yield start
