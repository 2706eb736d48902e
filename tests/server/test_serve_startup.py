"""`hpc-cli serve` as a process, as a new user starts it: a port in use and a model too big for the
memory are one `error:` line with a `hint:` before anything loads; a file that is not a prefix
cache is never overwritten; building the model shows progress; the no-reuse profile's banner says
the cache is off; each request is one log line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")  # the test extra

SERVE = [sys.executable, "-m", "hpc_cli", "serve", "--model", "builtin:random", "--device", "cpu", "--max-model-len",
         "1024",
         "--max-concurrency", "1", "--host-cache-mib", "16"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([*SERVE, *args], capture_output=True, text=True, env=_env(), timeout=timeout)
    return r, time.monotonic() - t0


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r, _ = _refused("--port", str(port))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: port {port} is in use\nhint: ")
    assert "--port" in r.stderr.splitlines()[1] and "Traceback" not in r.stderr
    assert "building" not in r.stderr and "serving" not in r.stderr  # nothing loaded, no banner


def test_model_too_big_for_memory_is_refused_with_its_size():
    r, seconds = _refused("--port", "0", "--model", "builtin:qwen3.5-27b-shape@400", "--dtype", "float32")
    assert r.returncode == 2, r.stderr
    first, hint = r.stderr.splitlines()[:2]
    assert first.startswith("error: builtin:qwen3.5-27b-shape@400 needs ") and " GiB for its float32 weights" in first
    assert hint.startswith("hint: ") and "--dtype bfloat16" in hint and "builtin:qwen3.5-27b-shape@4" in hint
    assert seconds < 45  # refused before building anything


def test_other_data_at_the_cache_path_is_refused_and_kept(tmp_path):
    path = tmp_path / "prefix.bin"
    data = os.urandom(100_000)
    path.write_bytes(data)
    r, _ = _refused("--port", "0", "--prefix-cache-file", str(path))
    assert r.returncode == 2 and "holds other data" in r.stderr and "\nhint: " in r.stderr, r.stderr
    assert path.read_bytes() == data


def test_no_reuse_banner_progress_and_one_line_per_request(tmp_path):
    port = _free_port()
    err = open(tmp_path / "stderr.txt", "w+")
    cmd = [a for a in SERVE if a not in ("--host-cache-mib", "16")]  # no-reuse allows no cache options
    proc = subprocess.Popen([*cmd, "--profile", "no-reuse.toml", "--port", str(port), "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=err, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, "hpc-cli serve exited: " + open(tmp_path / "stderr.txt").read()[-2000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="builtin:random", max_tokens=5,
                                           messages=[{"role": "user", "content": "Hi!"}])
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err.seek(0)
    text = err.read()
    assert "building builtin:random (" in text and "weights on cpu" in text  # progress while building
    assert "cache off" in text and "cache hybrid" not in text
    lines = [ln for ln in text.splitlines() if "POST /v1/chat/completions" in ln and "prompt " in ln]
    assert len(lines) == 1, text
    line = lines[0]
    for part in (" ok ", f"prompt {r.usage.prompt_tokens} tok", "cached 0", "ttft ",
                 f"output {r.usage.completion_tokens} tok"):
        assert part in line, (part, line)
    if r.usage.completion_tokens > 1:
        assert "tok/s" in line
