"""Issue 21, one regression test (or a few) per numbered case: no single request may kill,
freeze or flood the server, and the server says when it is broken. The real engine
(builtin:random on CPU) behind live loopback servers with serve's connection limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.errors import ConfigError, RequestError

from .hostile import (MODEL, chat_body, client, leaks, metric, raw_connect, read_until_closed, served, settings,
                      start_engine, wait_idle)

KEY = "sekrit-key"
LIMITS = {"server.max_request_bytes": 1 << 20, "server.header_timeout_s": 1.0, "server.body_timeout_s": 1.0,
          "server.keep_alive_timeout_s": 1.0}


@pytest.fixture(scope="module")
def world():
    """One engine, two servers: without a key (small limits) and with one."""
    engine, open_settings = start_engine(**LIMITS)
    keyed_settings = settings(**LIMITS, **{"server.api_key": KEY})
    with served(engine, open_settings) as srv, served(engine, keyed_settings) as keyed:
        yield engine, srv, keyed
    engine.stop(timeout=30)


def post(url: str, path: str, body: object, *, key: str | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with client(url, key, timeout) as c:
        return c.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})


def healthy(engine, url: str) -> None:
    assert engine.running and engine.fatal is None
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = post(url, "/v1/chat/completions", chat_body("still there?"))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------
# 1. a temperature in (0, ~1e-38) killed the engine
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat_body(temperature=1e-300)),
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 1e-300}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 3, "temperature": 1e-300,
                      "messages": [{"role": "user", "content": "hello"}]}),
])
def test_case01_tiny_temperature_is_greedy(world, path, body):
    engine, srv, _ = world
    r = post(srv.url, path, body)
    assert r.status_code == 200, r.text
    healthy(engine, srv.url)


def test_case01_tiny_temperature_samples_as_greedy():
    sp = SamplingParams(temperature=1e-300)
    sp.validate()
    assert sp.temperature == 0.0
    sp = SamplingParams(temperature=0.5)
    sp.validate()
    assert sp.temperature == 0.5


def test_case01_a_sampling_failure_fails_that_request_only(world, monkeypatch):
    engine, srv, _ = world
    import hpc_cli.engine.decode_step as engine_module

    real = engine_module.sample

    def failing(logits, params, generator, token=None):
        if params.top_k == 7:
            raise RuntimeError("probability tensor contains inf or nan")
        return real(logits, params, generator, token=token)

    monkeypatch.setattr(engine_module, "sample", failing)
    bad = engine.submit(GenerationRequest(list(b"hello there"), SamplingParams(max_tokens=3, top_k=7)))
    good = engine.submit(GenerationRequest(list(b"hello there"), SamplingParams(max_tokens=3, temperature=0)))
    _, fin_bad = bad.result(timeout=60)
    toks, fin_good = good.result(timeout=60)
    assert fin_bad.reason == "error" and "probability tensor" in fin_bad.error
    assert fin_good.reason == "length" and len(toks) == 3
    monkeypatch.setattr(engine_module, "sample", real)
    wait_idle(engine)
    assert leaks(engine) == []
    healthy(engine, srv.url)


# ---------------------------------------------------------------------------------------------
# 2. a seed outside [-2^63, 2^64) killed the engine before the lane existed
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 70, -(2 ** 63) - 1])
def test_case02_seed_out_of_range_is_a_400(world, seed):
    engine, srv, _ = world
    r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0.7,
                                          "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    with pytest.raises(RequestError):
        engine.submit(GenerationRequest(list(b"hi"), SamplingParams(max_tokens=2, temperature=0.7, seed=seed)))
    healthy(engine, srv.url)


def test_case02_edge_seeds_sample(world):
    engine, srv, _ = world
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0.7,
                                              "seed": seed, "n": 2})
        assert r.status_code == 200, r.text  # n = 2 adds 1 to the largest seed: past int64, still a seed
    from hpc_cli.engine.sampling import make_generator

    assert make_generator(SamplingParams(temperature=1.0, seed=2 ** 70), 1) is not None


def test_case02_a_generator_failure_fails_that_request_only(world, monkeypatch):
    engine, srv, _ = world
    import hpc_cli.engine.worker as engine_module

    def broken(params, index, base_seed=0):
        raise OverflowError("Overflow when unpacking long")

    monkeypatch.setattr(engine_module, "make_generator", broken)
    _, fin = engine.submit(GenerationRequest(list(b"hi"), SamplingParams(max_tokens=2))).result(timeout=60)
    assert fin.reason == "error" and "Overflow" in fin.error
    monkeypatch.undo()
    healthy(engine, srv.url)


# ---------------------------------------------------------------------------------------------
# 3. 2,000 one-word messages: quadratic prefix renders on the event loop froze the server
# ---------------------------------------------------------------------------------------------

def test_case03_prefix_renders_are_bounded():
    from hpc_cli.model.tokenizer import ByteTokenizer
    from hpc_cli.server.chat import RECENT_PREFIXES, prepare_chat

    tok = ByteTokenizer()
    calls = []
    render = tok.apply_chat_template

    def counting(messages, *a, **kw):
        calls.append(len(messages))
        return render(messages, *a, **kw)

    tok.apply_chat_template = counting
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word"} for i in range(2000)]
    prepared = prepare_chat(tok, msgs)
    assert len(calls) <= RECENT_PREFIXES + 2  # the full render, the first message, the last few
    assert len(prepared.message_boundaries) == 2000  # ChatML: every message start found in one scan


def test_case03_long_chats_do_not_stall_the_server(world):
    engine, srv, _ = world
    big = {"model": MODEL, "max_tokens": 1,
           "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": "word"} for i in range(6000)]}
    results = []

    def send():
        results.append(post(srv.url, "/v1/chat/completions", big, timeout=120).status_code)

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results == [400, 400]  # rendered (off the loop), then over the 512-token context
    assert worst < 2.0, f"/health took {worst:.2f} s while long chats rendered"


# ---------------------------------------------------------------------------------------------
# 4. no body limit; a 16 MiB model name echoed in the 404
# ---------------------------------------------------------------------------------------------

def test_case04_declared_oversize_body_is_413_at_once(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 5000000\r\n\r\n{")
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data, data[:300]
    assert seconds < 5


def test_case04_streamed_oversize_body_is_413(world):
    engine, srv, _ = world

    def chunks():
        yield b'{"model": "builtin:random", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536  # 2.5 MiB in all, chunked: no Content-Length to refuse up front
        yield b'"}'

    with client(srv.url) as c:
        try:
            r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        except httpx.HTTPError:  # the server may close while the client still writes
            r = None
    if r is not None:
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
    healthy(engine, srv.url)


def test_case04_anthropic_413_shape(world):
    engine, srv, _ = world
    r = post(srv.url, "/v1/messages", b'{"model": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"


def test_case04_unknown_model_is_not_echoed_whole(world):
    engine, srv, _ = world
    r = post(srv.url, "/v1/completions", {"model": "m" * 500_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.text) < 1000, len(r.text)


# ---------------------------------------------------------------------------------------------
# 5. fan-out without limit, and requests that ran on for a client that had left
# ---------------------------------------------------------------------------------------------

def test_case05_fanout_limit(world):
    engine, srv, _ = world
    r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 256, "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_generations", r.text
    assert engine.in_flight == 0
    r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": ["ab"] * 8, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def finished_cancelled(engine) -> int:
    st = engine.stats()
    return st.counters.get("finished_cancelled", 0) if st is not None else 0


def test_case05_fanout_is_cancelled_when_the_client_leaves(world):
    engine, srv, _ = world
    wait_idle(engine)
    before = finished_cancelled(engine)
    body = {"model": MODEL, "prompt": [f"prompt {i}" for i in range(16)], "n": 4, "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(srv.url, "/v1/completions", body, timeout=1.0)
    t0 = time.monotonic()
    wait_idle(engine, timeout=15)
    assert time.monotonic() - t0 < 10  # 64 x 200 tokens would take minutes on the CPU
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = finished_cancelled(engine)
        if after - before >= 60:
            break
        time.sleep(0.1)
    assert after - before >= 60  # nearly all were cancelled, not run for nobody


def test_case05_disconnect_watch_is_shared_across_handles():
    import asyncio

    from hpc_cli.server.common import ClientDisconnected, DisconnectWatch, iterate_events
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine().start()
    asks = []

    async def gone() -> bool:
        asks.append(time.monotonic())
        return True

    async def main() -> float:
        watch = DisconnectWatch(gone, every=0.2)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 10:  # each handle finishes at once: a timer per handle never fired
                handle = engine.submit(GenerationRequest(list(b"hi"), SamplingParams(max_tokens=2)))
                async for _ in iterate_events(handle, watch):
                    pass
        except ClientDisconnected:
            return time.monotonic() - t0
        return -1.0

    took = asyncio.run(main())
    engine.stop()
    # fired (a timer per handle never does: -1 after 10 s) and asked once; the bound is loose
    # because a loaded 2-core machine can hold the loop for a second (0.2 s when idle)
    assert 0 <= took < 5.0 and len(asks) == 1, (took, len(asks))


def test_case05_queue_bound_is_429_with_retry_after():
    engine, resolved = start_engine(**{"server.max_queued_requests": 0, "engine.max_concurrency": 1})
    try:
        with served(engine, resolved) as srv:
            long = {"model": MODEL, "prompt": "x", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json=long) as first:
                    lines = first.iter_lines()  # kept: a dropped iterator closes the connection
                    next(lines)
                    r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "y", "max_tokens": 1})
                    assert r.status_code == 429, r.text
                    assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
                    r = post(srv.url, "/v1/messages", {"model": MODEL, "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "y"}]})
                    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            wait_idle(engine)
            assert post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "y", "max_tokens": 1}).status_code == 200
    finally:
        engine.stop(timeout=30)


# ---------------------------------------------------------------------------------------------
# 6. after an engine fault: /health 503, the fatal gauge (fault injection: test_fault_injection.py)
# ---------------------------------------------------------------------------------------------

def test_case06_fatal_engine_is_reported(caplog):
    from hpc_cli.server.stop import StopController

    engine, resolved = start_engine()
    controller = StopController(engine, echo=lambda m: None, exit_on_fatal=False)
    try:
        with served(engine, resolved, controller) as srv:
            assert metric(httpx.get(srv.url + "/metrics").text, "hpc_engine_fatal") == 0

            def boom(lanes, finishing=()):
                raise RuntimeError("injected decode fault")

            engine._decode = boom
            with caplog.at_level("ERROR", logger="hpc_cli"):
                r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
                assert r.status_code == 500  # the request in flight fails
                health = httpx.get(srv.url + "/health")
            assert health.status_code == 503 and "injected decode fault" in health.json()["reason"]
            assert metric(httpx.get(srv.url + "/metrics").text, "hpc_engine_fatal") == 1
            again = post(srv.url, "/v1/chat/completions", chat_body())
            assert again.status_code == 503 and "restarted" in again.json()["error"]["message"]
            assert any("the engine stopped after an error" in r.getMessage() for r in caplog.records)
            assert not controller.stopping  # exit_on_fatal off: the server stays up, saying it is broken
    finally:
        engine.stop(timeout=30)


# ---------------------------------------------------------------------------------------------
# 7. 500 (and a reset connection) instead of 400
# ---------------------------------------------------------------------------------------------

DEEP = b'{"model": "builtin:random", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
HUGE_INT = b'{"model": "builtin:random", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
SURROGATE_OAI = b'{"model": "builtin:random", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
SURROGATE_ANT = b'{"model": "builtin:random", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}'


def _assistant_call(call: object) -> dict:
    return chat_body(messages=[{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "user", "content": "and?"}])


def _tool_use(block: dict) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", **block}]},
        {"role": "user", "content": "and?"}]}


BAD_REQUESTS = [
    ("/v1/completions", DEEP), ("/v1/chat/completions", DEEP.replace(b'"prompt"', b'"messages"')),
    ("/v1/messages", DEEP.replace(b'"prompt"', b'"messages"')),
    ("/v1/completions", HUGE_INT), ("/v1/messages", HUGE_INT),
    ("/v1/chat/completions", SURROGATE_OAI), ("/v1/messages", SURROGATE_ANT),
    ("/v1/completions", b'{"model": "builtin:random", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "builtin:random", "prompt": "hi", "temperature": NaN}'),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": "get_weather"})),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": {"name": None, "arguments": "{}"}})),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": {"name": 7, "arguments": "{}"}})),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": {"name": "f", "arguments": "{x"}})),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": {"name": "f", "arguments": "[1]"}})),
    ("/v1/chat/completions", _assistant_call({"type": "function", "function": {"name": "f",
                                                                               "arguments": "[" * 5000}})),
    ("/v1/messages", _tool_use({"id": "t1", "name": "f", "input": "a string"})),
    ("/v1/messages", _tool_use({"id": "t1", "name": None, "input": {}})),
    ("/v1/messages", _tool_use({"id": "t1", "name": 3, "input": {}})),
    ("/v1/messages", _tool_use({"id": 5, "name": "f", "input": {}})),
    ("/v1/chat/completions", chat_body(chat_template_kwargs={"tools": []})),
    ("/v1/chat/completions", chat_body(chat_template_kwargs={"messages": []})),
    ("/v1/chat/completions", chat_body(chat_template_kwargs={"add_generation_prompt": False})),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS, ids=[f"{i}:{p.rsplit('/', 1)[1]}" for i, (p, _) in
                                                          enumerate(BAD_REQUESTS)])
def test_case07_malformed_requests_are_400_and_keep_the_connection(world, path, body):
    engine, srv, _ = world
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with client(srv.url) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:500]
        err = r.json()
        assert (err["type"] == "error" and err["error"]["type"] == "invalid_request_error") if "messages" in path \
            else err["error"]["type"] == "invalid_request_error"
        assert c.get("/health").status_code == 200  # the same keep-alive connection still serves


def test_case07_well_formed_tool_history_still_renders(world):
    engine, srv, _ = world
    r = post(srv.url, "/v1/chat/completions", _assistant_call(
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}))
    assert r.status_code == 200, r.text
    r = post(srv.url, "/v1/messages", _tool_use({"id": "t1", "name": "f", "input": {"x": 1}}))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------
# 8. stalled connections were never timed out
# ---------------------------------------------------------------------------------------------

def test_case08_slow_headers_are_closed(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert data == b"" and seconds < 5  # header_timeout_s = 1


def test_case08_idle_connections_are_closed(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert seconds < 5


def test_case08_slow_body_is_408_and_closed(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"m")
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data, data[:300]
    assert seconds < 5


def test_case08_content_length_2_64_is_413(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551616\r\n\r\n")
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert data.startswith(b"HTTP/1.1 413") and seconds < 5, data[:300]


def test_case08_endless_headers_are_refused(world):
    engine, srv, _ = world
    s = raw_connect(srv.url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    try:
        for i in range(2000):
            s.sendall(b"X-Filler-%d: %s\r\n" % (i, b"y" * 64))
    except OSError:
        pass  # closed under us: refused
    data, seconds = read_until_closed(s, 10)
    s.close()
    assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:200]
    assert seconds < 5


def test_case08_many_stalled_connections_are_all_released(world):
    engine, srv, _ = world
    socks = []
    for i in range(60):
        s = raw_connect(srv.url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nabc" if i % 2 else b"PO")
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        read_until_closed(s, 10)
        s.close()
    assert time.monotonic() - t0 < 8
    deadline = time.monotonic() + 5
    while len(srv.server.server_state.connections) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(srv.server.server_state.connections) == 0
    healthy(engine, srv.url)


# ---------------------------------------------------------------------------------------------
# 9. a kill during the save left .pc.bin.<pid>.<tid>.tmp files behind
# ---------------------------------------------------------------------------------------------

def test_case09_stale_temp_files_are_removed_at_start(tmp_path):
    from hpc_cli.engine.cache_path import stale_temps
    from hpc_cli.server.startup import prepare_cache_file

    path = tmp_path / "pc.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f".pc.bin.{dead_pid}.{tid}.tmp" for tid in (1, 2)]
    live = tmp_path / f".pc.bin.{os.getppid()}.3.tmp"  # a running process's save: left alone
    other = tmp_path / f".other.bin.{dead_pid}.1.tmp"
    for p in (*stale, live, other):
        p.write_bytes(b"\0" * 1024)
    assert stale_temps(path) == sorted(stale)
    prepare_cache_file(path)
    assert not any(p.exists() for p in stale) and live.exists() and other.exists()


# ---------------------------------------------------------------------------------------------
# 10. crafted cache files with valid checksums raised out of attach_cache_file; a FIFO hung
# ---------------------------------------------------------------------------------------------

def _crafted(path, mutate) -> None:
    """Rewrite the header's JSON (same length, fresh checksum) of the cache file at ``path``."""
    from hpc_cli.cache.cachefile.format import PREAMBLE, U64, xxh3_64

    data = bytearray(path.read_bytes())
    pre = PREAMBLE.size
    magic, version, meta_len = PREAMBLE.unpack_from(data, 0)
    meta = json.loads(bytes(data[pre:pre + meta_len]))
    mutate(meta)
    text = json.dumps(meta).encode()
    assert len(text) <= meta_len
    text = text[:-1] + b" " * (meta_len - len(text)) + b"}"  # pad inside the object
    data[pre:pre + meta_len] = text
    U64.pack_into(data, pre + meta_len, xxh3_64(bytes(data[:pre + meta_len])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mutate", [lambda m: m.pop("fingerprint"), lambda m: m.update(fingerprint=["x"]),
                                    lambda m: m.update(fingerprint="string")], ids=["missing", "list", "string"])
def test_case10_crafted_cache_files_are_damaged_not_fatal(tmp_path, mutate):
    from hpc_cli.cache.cachefile.format import open_cache_file
    from hpc_cli.engine.persistence import attach_cache_file, save_engine_cache

    engine, _ = start_engine()
    engine.generate(GenerationRequest(list(range(1, 200)), SamplingParams(max_tokens=2, temperature=0)))
    engine.stop(timeout=30)
    path = tmp_path / "pc.bin"
    save_engine_cache(engine, path)
    _crafted(path, mutate)
    with pytest.raises(Exception) as info:
        open_cache_file(path)
    assert type(info.value).__name__ == "CacheFileError"
    from hpc_cli.engine.engine import Engine

    fresh = Engine.from_settings(settings())
    report = attach_cache_file(fresh, path, progress=False, save=False)
    assert not report.loaded and report.status != "restored"


def test_case10_fifo_cache_file_is_refused(tmp_path):
    from hpc_cli.engine.cache_path import check_cache_path

    fifo = tmp_path / "pc.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as info:
        settings(**{"cache.prefix_cache_file": str(fifo)})
    assert "not a regular file" in info.value.message and info.value.hint
    with pytest.raises(ConfigError):
        check_cache_path(fifo)
    with pytest.raises(ConfigError):
        check_cache_path("/dev/null")
    assert check_cache_path(tmp_path / "absent.bin") == tmp_path / "absent.bin"


# ---------------------------------------------------------------------------------------------
# 11. auth: /metrics open, --api-key "" disabled auth, x-api-key only on /v1/messages
# ---------------------------------------------------------------------------------------------

def test_case11_empty_api_key_is_an_error():
    with pytest.raises(ConfigError) as info:
        settings(**{"server.api_key": ""})
    assert "api_key" in info.value.message
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    proc = subprocess.run([sys.executable, "-m", "hpc_cli", "serve", "--api-key", "", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "api_key" in proc.stderr


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat_body()),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_case11_both_key_headers_on_every_route(world, path, body):
    engine, _, keyed = world
    assert post(keyed.url, path, body).status_code == 401
    assert post(keyed.url, path, body, key="wrong").status_code == 401
    assert post(keyed.url, path, body, headers={"x-api-key": "wrong"}).status_code == 401
    assert post(keyed.url, path, body, key=KEY).status_code == 200
    assert post(keyed.url, path, body, headers={"x-api-key": KEY}).status_code == 200
    for route in ("/v1/models", "/v1/cache/stats", "/metrics"):
        assert httpx.get(keyed.url + route).status_code == 401
        assert httpx.get(keyed.url + route, headers={"x-api-key": KEY}).status_code == 200
        assert httpx.get(keyed.url + route, headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_case11_health_answers_anyone_without_details(world):
    engine, _, keyed = world
    r = httpx.get(keyed.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(keyed.url + "/health", headers={"x-api-key": KEY}).json()["model"] == MODEL


def test_case11_protect_metrics_off():
    from hpc_cli.server.state import ServerState
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine()
    assert ServerState(engine, settings(**{"server.api_key": KEY})).protect_metrics
    assert not ServerState(engine, settings(**{"server.api_key": KEY, "server.protect_metrics": False})
                           ).protect_metrics
    assert not ServerState(engine, settings()).protect_metrics


# ---------------------------------------------------------------------------------------------
# 12. cross-tenant inference through the cache: cache_salt
# ---------------------------------------------------------------------------------------------

SECRET_SYSTEM = "You are the assistant of tenant A; the launch code is 0000-1111. " * 4


def _cached(r: httpx.Response) -> int:
    body = r.json()
    assert r.status_code == 200, body
    usage = body["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] if "prompt_tokens_details" in usage \
        else usage["cache_read_input_tokens"]


def test_case12_cache_salt_partitions_the_cache(world):
    engine, srv, _ = world

    def ask(salt: str | None, question: str) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        return _cached(post(srv.url, "/v1/chat/completions", chat_body(
            messages=[{"role": "system", "content": SECRET_SYSTEM}, {"role": "user", "content": question}],
            **extra)))

    assert ask("tenant-a", "first?") == 0
    assert ask("tenant-a", "second?") > 0  # the tenant's own reuse still works
    assert ask("tenant-b", "guess?") == 0  # another tenant learns nothing, not even timing
    assert ask(None, "guess?") == 0  # nor does an unsalted client
    assert ask(None, "again?") > 0  # unsalted clients share among themselves, as before
    assert ask("tenant-c", "guess?") == 0  # and a salted one cannot see theirs
    wait_idle(engine)
    assert leaks(engine) == []


def test_case12_short_prompts_never_share_root_snapshots(world):
    engine, srv, _ = world
    body = {"model": MODEL, "prompt": "short shared prefix", "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        post(srv.url, "/v1/completions", body)
    for salt in ("s1", "s1", "s2"):
        assert _cached(post(srv.url, "/v1/completions", {**body, "cache_salt": salt})) == 0


def test_case12_anthropic_cache_salt(world):
    engine, srv, _ = world

    def ask(**extra) -> httpx.Response:
        return post(srv.url, "/v1/messages", {"model": MODEL, "max_tokens": 2, "system": SECRET_SYSTEM,
                                              "messages": [{"role": "user", "content": "hello"}], **extra})

    ask(metadata={"user_id": "u", "cache_salt": "ant-a"})
    assert _cached(ask(metadata={"cache_salt": "ant-a"})) > 0
    assert _cached(ask(cache_salt="ant-a")) > 0  # top-level works the same
    assert _cached(ask(cache_salt="ant-b")) == 0
    assert ask(cache_salt="ant-a", metadata={"cache_salt": "other"}).status_code == 400
    assert ask(cache_salt="").status_code == 400
    assert ask(metadata={"cache_salt": 5}).status_code == 400


def test_case12_salted_keys():
    from hpc_cli.cache.keys import prepare_prompt

    tokens = list(range(200))
    plain, a, b = prepare_prompt(tokens), prepare_prompt(tokens, cache_salt="a"), prepare_prompt(tokens, cache_salt="b")
    assert plain.extras == [0, 0, 0] and a.salt and a.salt != b.salt
    assert all(x and x != y for x, y in zip(a.extras, b.extras))
    assert not set(a.hashes) & set(b.hashes) and not set(a.hashes) & set(plain.hashes)
    assert prepare_prompt(tokens, cache_salt="a").hashes == a.hashes  # stable: persisted files still match


# ---------------------------------------------------------------------------------------------
# 13. a client that disconnects mid-stream was counted as outcome="error"
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,endpoint,body", [
    ("/v1/chat/completions", "chat", chat_body(max_tokens=300, stream=True, ignore_eos=True)),
    ("/v1/completions", "completions", {"model": MODEL, "prompt": "x", "max_tokens": 300, "stream": True,
                                        "ignore_eos": True}),
    ("/v1/messages", "messages", {"model": MODEL, "max_tokens": 300, "stream": True,
                                  "messages": [{"role": "user", "content": "x"}]}),
])
def test_case13_mid_stream_disconnect_is_cancelled_not_error(world, path, endpoint, body):
    engine, srv, _ = world
    wait_idle(engine)
    before = httpx.get(srv.url + "/metrics").text
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    wait_idle(engine, timeout=20)
    deadline = time.monotonic() + 10
    while True:
        after = httpx.get(srv.url + "/metrics").text
        delta = (metric(after, "hpc_requests_total", endpoint=endpoint, outcome="cancelled")
                 - metric(before, "hpc_requests_total", endpoint=endpoint, outcome="cancelled"))
        if delta >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta == 1
    assert metric(after, "hpc_requests_total", endpoint=endpoint, outcome="error") == \
        metric(before, "hpc_requests_total", endpoint=endpoint, outcome="error")
    assert metric(after, "hpc_requests_running") == 0


# ---------------------------------------------------------------------------------------------
# 14. serve --seed changed nothing
# ---------------------------------------------------------------------------------------------

def _sampled(seed: int) -> list[int]:
    from hpc_cli.engine.engine import Engine

    engine = Engine.from_settings(settings(**{"engine.seed": seed})).start()
    try:
        return [engine.generate(GenerationRequest(list(b"tell me"), SamplingParams(max_tokens=12,
                                                                                    temperature=1.0)))[0]
                for _ in range(2)]
    finally:
        engine.stop(timeout=30)


def test_case14_seed_is_the_sampling_base_seed():
    a, b, again = _sampled(7), _sampled(12345), _sampled(7)
    assert a == again  # the same base seed: the same tokens, request by request
    assert a != b
    assert a[0] != a[1]  # consecutive requests still draw differently
    from hpc_cli.cli.serve_cmd import FLAG_KEYS

    assert FLAG_KEYS["seed"] == "engine.seed"
    with pytest.raises(ConfigError):
        load_model_seed()


def load_model_seed():
    """model.seed is gone: it never seeded anything."""
    return settings(**{"model.seed": 3})


def test_case14_request_seed_wins():
    from hpc_cli.engine.sampling import make_generator

    params = SamplingParams(temperature=1.0, seed=42)
    g1, g2 = make_generator(params, 1, base_seed=0), make_generator(params, 9, base_seed=99)
    assert g1.initial_seed() == g2.initial_seed() == 42


def test_servers_still_healthy_after_every_case(world):
    engine, srv, keyed = world
    healthy(engine, srv.url)
    assert httpx.get(keyed.url + "/health").status_code == 200
    wait_idle(engine)
    assert leaks(engine) == []
