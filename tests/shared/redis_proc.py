"""A real redis-server for tests: on a free loopback port with its own temporary directory, no
persistence, stopped (and waited for) by :meth:`RedisProcess.stop`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def redis_binary() -> str:
    """redis-server (or valkey-server); skipped when neither is installed, except in CI, where
    .ci/run installs it and its absence is a failure."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    pytest.skip("redis-server is not installed (apt-get install redis-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    def __init__(self, directory: Path, port: int | None = None, maxmemory_mib: int = 256) -> None:
        self.binary = redis_binary()
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.maxmemory_mib = maxmemory_mib
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisProcess":
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", "--maxmemory", f"{self.maxmemory_mib}mb",
               "--maxmemory-policy", "allkeys-lru", "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited: " + self._log()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise AssertionError("redis-server did not answer: " + self._log())

    def _log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
