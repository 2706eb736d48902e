"""A restart through the server (spec §5.5): `hpc-cli serve --prefix-cache-file` as a process on
127.0.0.1, a two-turn chat with the official openai client, SIGTERM (the orderly stop saves),
`hpc-cli cache verify`, serve again: turn 3 reports cached tokens restored from the host tier and
gives the same greedy output as a cold server. Then Ctrl+C twice (the stop) and once more (the
save is abandoned): the previous file stays."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")  # the test extra; absent on bare machines

try:
    import hpc_cli.engine.engine  # noqa: F401
except ImportError as exc:  # pragma: no cover - until the engine lands
    pytest.skip(f"hpc_cli.engine.engine does not import yet: {exc}", allow_module_level=True)

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SYSTEM = "You are a careful assistant who answers briefly and keeps a long memory. " * 4
START_S = 60  # bounded waits: server start, requests, stops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, tmp: Path, name: str, cache_file: Path | None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
        cmd = [sys.executable, "-m", "hpc_cli", "serve", "--model", "builtin:random",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--max-model-len", "2048", "--max-concurrency", "2", "--host-cache-mib", "64",
               "--log-level", "info"]
        if cache_file is not None:
            cmd += ["--prefix-cache-file", str(cache_file)]
        self.err_path = tmp / f"stderr-{name}.txt"
        self.err = open(self.err_path, "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, env=env)

    def wait_up(self) -> "Served":
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        pytest.fail("hpc-cli serve did not come up: " + self.stderr()[-3000:])

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text(errors="replace")

    def wait_stderr(self, text: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert time.monotonic() < deadline, f"{text!r} not in the server's stderr: " + self.stderr()[-3000:]
            time.sleep(0.01)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def chat(self, messages: list[dict]):
        return self.client().chat.completions.create(model="builtin:random", messages=messages, max_tokens=8,
                                                     temperature=0, extra_body=NO_THINK)

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/cache/stats", timeout=5).json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def serving(tmp: Path, name: str, cache_file: Path | None):
    s = Served(tmp, name, cache_file)
    try:
        yield s
    finally:
        s.kill()
        s.err.close()


def _restored(stats: dict) -> tuple[int, int]:
    cache = stats.get("cache") or {}
    index = cache.get("index") or {}
    counters = index.get("counters") or cache.get("counters") or {}
    restored = (stats.get("counters") or {}).get("restored_host_bytes", 0) or cache.get("restored_host_bytes", 0)
    return int(restored or 0), int(counters.get("restores", 0) or 0)


def _build_id() -> str:
    """The product part of the file's fingerprint, computed now (it follows hpc_cli's sources)."""
    from hpc_cli.engine.persistence import build_id as cached

    return cached.__wrapped__()


def _skip_if_rebuilt(built: str, text: str) -> None:
    if "fingerprint differs in product" in text and _build_id() != built:
        pytest.skip("hpc_cli's sources changed while the test ran (the file's build id no longer matches)")


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_cli", "cache", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Server A: two turns, then SIGTERM (the orderly stop saves the host tier)."""
    tmp = tmp_path_factory.mktemp("serve-restart")
    path = tmp / "p.bin"
    built = _build_id()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prefix cache?"}]
    with serving(tmp, "a", path) as a:
        a.wait_up()
        for turn in range(2):
            r = a.chat(messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content or "ok"},
                         {"role": "user", "content": f"And what about question {turn + 2}?"}]
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=START_S) == 0, a.stderr()[-3000:]
        assert "prefix cache saved" in a.stderr(), a.stderr()[-3000:]
    return path, messages, built


def test_restart_through_server(saved, tmp_path):
    path, messages, built = saved
    assert path.exists() and path.stat().st_size > 0
    v = _verify(path)
    assert v.returncode == 0, v.stdout + v.stderr
    # server B (the same flags: the file loads) and server C (cold, no file), started together
    with serving(tmp_path, "b", path) as b, serving(tmp_path, "c", None) as c:
        b.wait_up()
        c.wait_up()
        _skip_if_rebuilt(built, b.stderr())
        assert "prefix cache restored" in b.stderr(), b.stderr()[-3000:]
        rb = b.chat(messages)
        rc = c.chat(messages)
        assert rb.usage.prompt_tokens == rc.usage.prompt_tokens
        assert rb.usage.prompt_tokens_details.cached_tokens > 0, rb.usage
        assert rc.usage.prompt_tokens_details.cached_tokens == 0, rc.usage
        assert rb.choices[0].message.content == rc.choices[0].message.content
        deadline = time.monotonic() + 10  # the engine's stats snapshot is taken every 0.2 s
        while True:
            restored_bytes, restores = _restored(b.stats())
            if restored_bytes > 0 or restores > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert restored_bytes > 0 or restores > 0, b.stats()
        # ... and C's cold answer came from no host tier
        assert _restored(c.stats()) == (0, 0)
        c.proc.send_signal(signal.SIGTERM)
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(timeout=START_S) == 0 and c.proc.wait(timeout=START_S) == 0


def test_third_ctrl_c_abandons_the_save(saved, tmp_path):
    path = tmp_path / "p.bin"
    shutil.copyfile(saved[0], path)  # the previous file: it loads, and must stay as it is
    previous = path.read_bytes()
    before = path.stat()
    with serving(tmp_path, "d", path) as d:
        d.wait_up()
        _skip_if_rebuilt(saved[2], d.stderr())
        assert "prefix cache restored" in d.stderr(), d.stderr()[-3000:]
        d.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something to save."}])
        d.proc.send_signal(signal.SIGINT)
        d.wait_stderr("again within 5 s")
        d.proc.send_signal(signal.SIGINT)  # the stop starts ...
        d.wait_stderr("stopping (Ctrl+C)")
        d.proc.send_signal(signal.SIGINT)  # ... and one more Ctrl+C abandons the save
        rc = d.proc.wait(timeout=START_S)
        text = d.stderr()
    assert rc == 130, text[-3000:]
    assert "the prefix cache is not saved" in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    if "prefix cache saved" in text:
        # The third press raced a save that had already passed its last abandon check (a small
        # file saves in milliseconds): the new file is then complete. The abandon itself is
        # tested deterministically in test_file_format.py and test_engine_restart.py.
        assert subprocess.run([sys.executable, "-m", "hpc_cli", "cache", "verify", str(path)],
                              capture_output=True).returncode == 0
        return
    after = path.stat()
    assert path.read_bytes() == previous
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
