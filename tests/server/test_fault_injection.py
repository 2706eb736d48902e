"""Fault injection (issue 21): `hpc-cli serve` as a process, with a fault forced into it by a
wrapper that patches one function before the CLI runs: an exception in the engine's worker, a
failed host transfer, a host tier that cannot be allocated at startup. Each asserts what an
operator and a supervisor see: /health 503 with the reason, the exit status, the log line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

WRAPPER = textwrap.dedent('''
    import sys

    fault = sys.argv[1]
    if fault == "worker":  # the first decode round of a served request raises
        from hpc_cli.engine.engine import Engine

        real = Engine._decode

        def decode(self, lanes, finishing=()):
            if any(lane.request.request_id != "warmup" for lane in lanes):
                raise RuntimeError("injected worker fault")
            return real(self, lanes, finishing)

        Engine._decode = decode
    elif fault == "transfer":  # the first write-through to the host tier fails
        from hpc_cli.memory.transfer import engine as transfer
        from hpc_cli.memory.transfer.records import Completion

        real_poll = transfer.TransferEngine.poll

        def poll(self):
            return [Completion(c.job_id, c.kind, "injected transfer fault") if c.kind == "write" else c
                    for c in real_poll(self)]

        transfer.TransferEngine.poll = poll
    elif fault == "host":  # no chunk of the host tier can be allocated
        from hpc_cli.errors import CapacityError
        from hpc_cli.memory import host_slabs

        def alloc(self, nbytes):
            raise CapacityError(f"cannot allocate the host cache: a chunk of {nbytes} B failed: injected")

        host_slabs.HostSlabStorage._alloc_chunk = alloc
    from hpc_cli.cli import main

    main(sys.argv[2:])
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, tmp_path, fault: str, *extra: str, env: dict | None = None) -> None:
        wrapper = tmp_path / "inject.py"
        wrapper.write_text(WRAPPER)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
        environ.update(env or {})
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)
        self.log = open(tmp_path / "stderr.txt", "w+")
        cmd = [sys.executable, str(wrapper), fault, "serve", "--model", "builtin:random", "--port", str(self.port), "--device", "cpu",
               "--max-model-len", "512", "--max-concurrency", "1", "--host-cache-mib", "16", "--log-level",
               "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=environ)

    def up(self, timeout: float = 90) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return True
            except httpx.HTTPError:
                time.sleep(0.1)
        return False

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("hpc-cli serve did not exit: " + self.stderr()[-3000:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve_with(tmp_path):
    started = []

    def start(fault: str, *extra: str, env: dict | None = None) -> Served:
        s = Served(tmp_path, fault, *extra, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "builtin:random", "prompt": "hello " * 40,
                                                     "max_tokens": 4}, timeout=60)


def test_worker_exception_exits_3_with_the_reason(serve_with):
    srv = serve_with("worker")
    assert srv.up(), srv.stderr()[-3000:]
    r = _complete(srv.url)
    assert r.status_code == 500 and "injected worker fault" in r.json()["error"]["message"]
    assert srv.wait() == 3
    err = srv.stderr()
    assert "the engine stopped after an error: RuntimeError: injected worker fault" in err
    assert "Traceback" in err  # the worker's own traceback is in the log
    assert "error: the engine stopped after an error: RuntimeError: injected worker fault" in err
    assert "hint: " in err


def test_worker_exception_without_exit_reports_503(serve_with, tmp_path):
    cache_file = tmp_path / "pc.bin"
    srv = serve_with("worker", "--prefix-cache-file", str(cache_file), env={"HPC_SERVER__EXIT_ON_FATAL": "false"})
    assert srv.up(), srv.stderr()[-3000:]
    assert _complete(srv.url).status_code == 500
    health = httpx.get(srv.url + "/health", timeout=5)
    assert health.status_code == 503 and "injected worker fault" in health.json()["reason"]
    metrics = httpx.get(srv.url + "/metrics", timeout=5).text
    assert "hpc_engine_fatal 1.0" in metrics
    assert _complete(srv.url).status_code == 503
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait() == 0
    err = srv.stderr()
    assert "prefix cache not saved to" in err and "the engine stopped after an error" in err
    assert not cache_file.exists()  # nothing is saved from a failed engine


def test_failed_transfer_exits_3(serve_with):
    srv = serve_with("transfer")
    assert srv.up(), srv.stderr()[-3000:]
    # its first host write (the tail tap's snapshot during the prefill, or the blocks at release)
    # fails: the request in flight then ends with the engine's error, or completes first
    first = _complete(srv.url)
    assert first.status_code == 200 or (first.status_code == 500 and "injected transfer fault" in first.text), \
        first.text
    deadline = time.monotonic() + 30
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            health = httpx.get(srv.url + "/health", timeout=2)
        except httpx.HTTPError:
            break
        if health.status_code == 503:
            assert "injected transfer fault" in health.json().get("reason", "") or \
                health.json().get("status") == "stopping"
            break
        _complete(srv.url)
        time.sleep(0.1)
    assert srv.wait() == 3
    err = srv.stderr()
    assert "write transfer" in err and "injected transfer fault" in err
    assert "error: the engine stopped after an error" in err


def test_host_tier_that_cannot_be_allocated_refuses_the_start(serve_with):
    srv = serve_with("host")
    assert srv.wait(120) == 2
    err = srv.stderr()
    assert "error: the host cache tier could not be allocated" in err and "injected" in err
    assert "hint: lower --host-cache-mib" in err
    assert "Traceback" not in err
