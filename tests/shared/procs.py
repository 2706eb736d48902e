"""Real `hpc-cli serve` processes for the shared-tier tests: loopback only, bounded waits, and
every process stopped (SIGTERM, then SIGKILL) by whoever started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MODEL = "builtin:random"
SERVE_ARGS = ("--model", MODEL, "--device", "cpu", "--max-model-len", "4096", "--max-concurrency", "2",
              "--host-cache-mib", "64", "--log-level", "warning")


def child_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HPC_")}, "NO_COLOR": "1"}


def http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=60)


class Served:
    """``hpc-cli serve`` on 127.0.0.1:port with its stderr in a file."""

    def __init__(self, tmp: Path, name: str, port: int, *extra: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.err_path = tmp / f"serve-{name}.txt"
        cmd = [sys.executable, "-P", "-m", "hpc_cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               *SERVE_ARGS, *extra]
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                         env=child_env())

    def wait_up(self, timeout: float = 90) -> "Served":
        wait_health(self.url, timeout, self.proc, self.stderr)
        return self

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stats(self) -> dict:
        with http() as c:
            return c.get(self.url + "/v1/cache/stats").json()["cache"]

    def stop(self, timeout: float = 30) -> int | None:
        return stop_process(self.proc, timeout)


def wait_health(url: str, timeout: float, proc: subprocess.Popen | None = None, log=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2) as c:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{url} exited with {proc.returncode}: {log()[-3000:]}")
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout} s: {log()[-3000:]}")


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def chat(url: str, messages: list[dict], max_tokens: int = 8) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one chat completion; any error fails the test."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **NO_THINK}
    with http() as c:
        r = c.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    u = d["usage"]
    return d["choices"][0]["message"]["content"] or "", u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def conversation(seed: str) -> list[dict]:
    return [{"role": "system", "content": f"[{seed}] You are a careful assistant with a long memory. " * 12},
            {"role": "user", "content": f"[{seed}] Describe the weather of the coast in detail. " * 4}]


def next_turn(messages: list[dict], answer: str, text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": text * 3}]
