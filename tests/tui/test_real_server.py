"""`hpc-cli top` and `hpc-cli serve --tui` against the real server (`hpc-cli serve` as a process
on 127.0.0.1, builtin:random on the CPU): the frame shows the numbers /v1/cache/stats serves,
/metrics stays clean, a stopped server reads as one line, and the in-process view never takes the
server down."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hpc_cli.tui.render import fmt_bytes, fmt_count, fmt_pct

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(width: int = 80, height: int = 24) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    env.update(COLUMNS=str(width), LINES=str(height), NO_COLOR="1", TERM="dumb")
    return env


def _serve(tmp_path, *extra: str, stdout=subprocess.DEVNULL, env=None):
    port = _free_port()
    cmd = [sys.executable, "-m", "hpc_cli", "serve", "--model", "builtin:random", "--port", str(port), "--device",
           "cpu", "--max-model-len", "2048", "--host-cache-mib", "64", "--log-level", "warning", *extra]
    err = open(tmp_path / f"serve-{port}.err", "w+")
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=env or _env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                return proc, url, err
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    err.seek(0)
    pytest.fail("hpc-cli serve did not come up: " + err.read()[-2000:])


def _stop(proc) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def _chat(url: str, question: str) -> object:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", http_client=httpx.Client(trust_env=False))
    r = client.chat.completions.create(
        model="builtin:random", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return r.usage


def _top(url: str, width: int = 80, height: int = 24, *args: str) -> subprocess.CompletedProcess:
    """`hpc-cli top --url URL ARGS` as a process (a console of WIDTH x HEIGHT, not a terminal)."""
    return subprocess.run([sys.executable, "-m", "hpc_cli", "top", "--url", url, *args], capture_output=True,
                          text=True, timeout=60, env=_env(width, height))


def _top_in_process(url: str, *args: str):
    """The same in this process (80x24; the HTTP client is as real): saves a process start."""
    from click.testing import CliRunner

    from hpc_cli.cli import cli

    return CliRunner(env={"COLUMNS": "80", "LINES": "24", "NO_COLOR": "1"}).invoke(cli, ["top", "--url", url, *args])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `hpc-cli serve --tui` for the module (its view goes to a file: not a terminal), with
    three chats that share a system prompt (snapshots, reuse, host slabs). The last test stops it."""
    tmp = tmp_path_factory.mktemp("top")
    out_path = tmp / "tui.out"
    out = open(out_path, "w")
    proc, url, err = _serve(tmp, "--tui", stdout=out, env=_env(100, 30))
    try:
        usages = [_chat(url, q) for q in ("What is a prefix cache?", "And a snapshot?", "Why hybrid?")]
        time.sleep(0.6)  # the worker publishes its stats a few times a second
        yield {"proc": proc, "url": url, "usages": usages, "tui": out_path, "err": err}
    finally:
        _stop(proc)
        out.close()
        err.close()


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats", timeout=5, trust_env=False).json()


def test_top_once_shows_the_servers_numbers(server):
    url = server["url"]
    assert sum(u.prompt_tokens_details.cached_tokens for u in server["usages"]) > 0, "the chats shared no prefix"
    s = _stats(url)
    cache = s["cache"]
    assert cache["top_snapshots"] and "inflight" in cache and s["settings"]["cache_mode"] == "hybrid"

    r = _top(url, 120, 40, "--once")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    lines = out.split("\n")
    assert all(len(line) <= 120 for line in lines)
    assert f"hpc-cli top {s['model']}  kv bf16  spec none  cache hybrid" in out
    assert f"Device KV pages {fmt_count(cache['pages'])} × {fmt_bytes(cache['page_bytes'])}" in out
    assert re.search(rf"Free +█*░* +{cache['pool']['free']} ", out)
    assert re.search(rf"Cached +█*░* +{cache['pool']['cached']} ", out)
    host = cache["index"]["host"]
    assert f"Host slabs {fmt_count(host['slabs'])} × {fmt_bytes(host['slab_bytes'])}" in out
    assert re.search(rf"KV blocks +█*░* +{host['slabs_by_use'].get('node', 0)} ", out)
    c = s["counters"]
    assert re.search(rf"Hit rate +{fmt_pct(c['reuse_tokens'] / c['prompt_tokens'])} ", out)
    assert re.search(rf"Reuse tok +{fmt_count(c['reuse_tokens'])} ", out)
    assert f"total {c['requests']}" in out
    for row in cache["top_snapshots"]:  # every row of the table, as served
        assert any(re.match(rf"\W*{row['id']}\s+{fmt_count(row['frontier'])}\s+{row['kind']}\s+{row['residency']}"
                            rf"\s+{row['tail']}\s+{fmt_count(row['hits'])}\s", line) for line in lines), row

    small = _top_in_process(url, "--once")
    assert small.exit_code == 0, small.stderr
    small_lines = small.stdout.rstrip("\n").split("\n")
    assert len(small_lines) <= 24 and all(len(line) <= 80 for line in small_lines)
    assert "Snapshots" in small.stdout and "Requests" in small.stdout


def test_metrics_of_the_real_server_are_clean(server):
    text = httpx.get(server["url"] + "/metrics", timeout=5, trust_env=False).text
    assert "top_snapshots" not in text and "ttft_recent_s" not in text
    assert "hpc_engine_cache_pool_free " in text and "hpc_engine_cache_inflight_restore_bytes 0" in text
    names = set()
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?", name), line
        float(value)
        assert name not in names, f"{name} twice"
        names.add(name)


def test_serve_tui_then_stop_then_top_is_one_line(server):
    """`serve --tui` to a file: rich.live draws nothing on a non-terminal until it stops, so the
    view prints whole frames there (the first at once, the last at the stop) while the server
    serves. After the stop, `hpc-cli top --once` says so in one line."""
    proc, url, tui = server["proc"], server["url"], server["tui"]
    assert "Device KV pages" in tui.read_text(), "no first frame"
    assert httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200
    assert _stop(proc) == 0
    text = tui.read_text()
    server["err"].seek(0)
    log = server["err"].read()
    assert "Traceback" not in log and "live view stopped" not in log
    head = "hpc-cli top builtin:random  kv bf16  spec none  cache hybrid"
    assert text.count(head) >= 2, text
    last = text.split(head)[-1]
    assert url in last and f"total {len(server['usages'])}" in last  # the view names where it listens
    assert all(len(line) <= 100 for line in text.split("\n"))

    r = _top_in_process(url, "--once")
    assert r.exit_code == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.startswith(f"error: cannot reach {url} (connection refused)"), r.stderr
    assert len(r.stderr.strip().split("\n")) == 2  # the error and the hint


def test_view_failure_never_reaches_the_server(capsys):
    from rich.console import Console

    from hpc_cli.tui.app import start_tui_thread

    class Broken:
        running = True
        cache = None

        def stats(self):
            return {"model": "m", "cache": "not a dict"}  # build_view cannot read it

    console = Console(file=open(os.devnull, "w"), width=80, height=24, force_terminal=False)
    th, stop = start_tui_thread(Broken(), None, console=console)
    th.join(10)
    assert not th.is_alive()
    assert "hpc-cli: the live view stopped (AttributeError" in capsys.readouterr().err

    class Fine(Broken):
        def __init__(self):
            self.calls = 0

        def stats(self):
            self.calls += 1
            return {}

    eng = Fine()
    th, stop = start_tui_thread(eng, None, console=console)
    time.sleep(0.3)
    assert th.is_alive() and eng.calls >= 1
    stop.set()
    th.join(5)
    assert not th.is_alive()
