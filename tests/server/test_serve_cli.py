"""`hpc-cli serve` as a process on 127.0.0.1: the banner, a request, and the orderly stop by
SIGTERM and by a confirmed Ctrl+C (two SIGINTs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

try:
    import hpc_cli.engine.engine  # noqa: F401
except ImportError as exc:  # pragma: no cover - until the engine lands
    pytest.skip(f"hpc_cli.engine.engine does not import yet: {exc}", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    cmd = [sys.executable, "-m", "hpc_cli", "serve", "--model", "builtin:random", "--port", str(port), "--device",
           "cpu", "--max-model-len", "1024", "--max-concurrency", "1", "--host-cache-mib", "16", "--log-level", "warning"]
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, err
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    err.seek(0)
    pytest.fail("hpc-cli serve did not come up: " + err.read()[-2000:])


def _stderr(err) -> str:
    err.flush()
    err.seek(0)
    return err.read()


@pytest.mark.parametrize("how", ["sigterm", "double-ctrl-c"])
def test_serve_stops_in_order(tmp_path, how):
    proc, url, err = _start(tmp_path)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "builtin:random", "prompt": "hi", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            assert proc.poll() is None, "one Ctrl+C must not stop the server"
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = _stderr(err)
    assert "random" in text and "meaningless" in text and "--model" in text
    assert "stopping" in text
    if how == "double-ctrl-c":
        assert "again within 5 s" in text
