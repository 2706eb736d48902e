"""A bounded soak (issue 21): 8 concurrent clients against the real engine (builtin:random on CPU)
behind a live loopback server, every API, streaming and not, half of them leaving mid-stream
or mid-wait. Afterwards nothing leaks: the cache invariants hold, no sequence is live, no block
or snapshot is pinned, no lane or state slot is held, /metrics counts every request as ok or
cancelled (never error) and nothing as running."""

from __future__ import annotations

import random
import threading
import time

import httpx

from .hostile import MODEL, NO_THINK, leaks, metric, served, start_engine, wait_idle

CLIENTS = 8
SECONDS = 12.0
SYSTEM = "You are a soak-test assistant who shares a long prefix with its siblings. " * 3
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}


def body(path: str, rng: random.Random, stream: bool) -> dict:
    max_tokens = rng.choice([2, 8, 40])
    salt = {"cache_salt": rng.choice(["t1", "t2"])} if rng.random() < 0.3 else {}
    question = f"question {rng.randrange(5)}"
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": SYSTEM + question, "max_tokens": max_tokens, "stream": stream,
                "temperature": rng.choice([0, 0.8]), **salt}
    if path == "/v1/messages":
        return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "system": SYSTEM,
                "messages": [{"role": "user", "content": question}], **salt}
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "chat_template_kwargs": NO_THINK,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **salt}


def client_loop(url: str, seed: int, deadline: float, tally: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        while time.monotonic() < deadline:
            path = rng.choice(list(ENDPOINTS))
            stream = rng.random() < 0.6
            leave = rng.random() < 0.5
            kind = ("stream" if stream else "wait") + ("-leave" if leave else "")
            try:
                if stream:
                    with c.stream("POST", path, json=body(path, rng, True)) as r:
                        assert r.status_code == 200, r.read()
                        lines = r.iter_lines()
                        for _ in range(rng.randrange(1, 6) if leave else 10 ** 9):
                            if next(lines, None) is None:
                                break
                else:
                    r = c.post(path, json=body(path, rng, False), timeout=rng.uniform(0.05, 0.4) if leave else 60)
                    assert r.status_code == 200, r.text
            except httpx.TimeoutException:
                assert leave, "a patient client timed out"
            with lock:
                tally[kind] = tally.get(kind, 0) + 1
                tally["total"] = tally.get("total", 0) + 1


def test_soak_with_disconnects_leaks_nothing():
    engine, resolved = start_engine(**{"engine.max_concurrency": 4, "model.max_model_len": 1024})
    try:
        with served(engine, resolved) as srv:
            tally: dict[str, int] = {}
            lock = threading.Lock()
            deadline = time.monotonic() + SECONDS
            threads = [threading.Thread(target=client_loop, args=(srv.url, seed, deadline, tally, lock))
                       for seed in range(CLIENTS)]
            errors: list[BaseException] = []

            def guarded(t: threading.Thread) -> None:
                try:
                    t.run()
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            runners = [threading.Thread(target=guarded, args=(t,)) for t in threads]
            for t in runners:
                t.start()
            for t in runners:
                t.join(SECONDS + 120)
            assert not errors, errors
            assert not any(t.is_alive() for t in runners), "a client hung"
            wait_idle(engine, timeout=60)
            assert engine.running and engine.fatal is None
            assert leaks(engine) == []
            deadline = time.monotonic() + 10
            while True:  # the last streams' trackers settle when their generators close
                text = httpx.get(srv.url + "/metrics").text
                counted = sum(metric(text, "hpc_requests_total", endpoint=e, outcome=o)
                              for e in ENDPOINTS.values() for o in ("ok", "cancelled"))
                if counted >= tally["total"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            errors_counted = sum(metric(text, "hpc_requests_total", endpoint=e, outcome="error")
                                 for e in ENDPOINTS.values())
            cancelled = sum(metric(text, "hpc_requests_total", endpoint=e, outcome="cancelled")
                            for e in ENDPOINTS.values())
            assert errors_counted == 0
            assert counted == tally["total"], (counted, tally)
            assert cancelled >= 1 and tally.get("stream-leave", 0) + tally.get("wait-leave", 0) >= 8, tally
            assert metric(text, "hpc_requests_running") == 0
            assert httpx.get(srv.url + "/health").status_code == 200
            print(f"soak: {tally}, cancelled {cancelled:.0f}")
    finally:
        engine.stop(timeout=30)
