"""`hpc-cli cluster up` as a real process tree: redis-server, two replicas, sglang-router with its
cache-aware policy. A seeded multi-session trace through the router reuses at least 0.95 of what
one server reuses on the same trace; a conversation whose turns land on different replicas
resumes from the shared tier; a fresh replica added mid-trace serves its first turn from it;
SIGTERM stops every process."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .procs import SERVE_ARGS, Served, chat, child_env, conversation, next_turn, stop_process, wait_health
from .redis_proc import free_port, redis_binary

pytest.importorskip("openai")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_trace.py"


def _router_installed() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        if os.environ.get("CI"):
            pytest.fail("sglang-router is not installed (the test extra installs it)")
        pytest.skip("sglang-router is not installed (pip install sglang-router)")


def _trace_module():
    spec = importlib.util.spec_from_file_location("serve_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_trace"] = mod
    spec.loader.exec_module(mod)
    return mod


def _port_block(n: int) -> int:
    """A base port with n free ports from it."""
    from hpc_cli.cluster import port_free

    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        if all(port_free(base + i) for i in range(n)):
            return base
    raise AssertionError("no block of free loopback ports")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of our own child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _read_json_line(proc: subprocess.Popen, timeout: float, log: Path) -> dict:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert out and out[0].strip(), "cluster up printed no endpoints: " + log.read_text(errors="replace")[-3000:]
    return json.loads(out[0])


def test_cluster_trace_cross_replica_and_fresh_replica(tmp_path):
    _router_installed()
    redis_binary()
    base = _port_block(4)
    err = open(tmp_path / "cluster.txt", "wb")
    cmd = [sys.executable, "-P", "-m", "hpc_cli", "cluster", "up", "--replicas", "2", "--port", str(base), "--json",
           "--log-dir", str(tmp_path / "logs"), "--startup-timeout", "120", *SERVE_ARGS]
    cluster = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                               env=child_env())
    single = Served(tmp_path, "single", free_port())  # the same trace on one server, no shared tier
    fresh = None
    try:
        ep = _read_json_line(cluster, 150, tmp_path / "cluster.txt")
        router = ep["router"]["url"]
        r1, r2 = (r["url"] for r in ep["replicas"])
        assert router == f"http://127.0.0.1:{base}" and (r1, r2) == (f"http://127.0.0.1:{base + 1}",
                                                                     f"http://127.0.0.1:{base + 2}")
        assert ep["router_kind"] == "sglang" and ep["redis"]["url"] == f"redis://127.0.0.1:{base + 3}/0"
        single.wait_up()
        with httpx.Client(trust_env=False, timeout=10) as c:
            assert c.get(router + "/v1/models").json()["data"][0]["id"] == "builtin:random"

        # the trace: 6 sessions x 3 turns, two sessions at a time, through the router and on one server
        st = _trace_module()
        cfg = st.TraceConfig(seed=11, sessions=6, turns=3, preamble_tokens=400, user_tokens=(40, 160), edits=False,
                             edit_prob=0.0)
        trace = st.build_trace(cfg, 1, st.TokenCounter(None))
        runs = {name: st.replay(url, name, "builtin:random", trace, 0, 2, 8, 120.0)
                for name, url in (("cluster", router), ("single", single.url))}
        share = {}
        for name, run in runs.items():
            s = st.summarize(run, cfg.sessions)
            assert s.errors == 0 and s.requests == 18, [r.error for r in run.records if r.error]
            share[name] = s.reuse_share
        assert share["single"] > 0.5 and share["cluster"] >= 0.95 * share["single"], share

        # one conversation, its turns on different replicas: the second resumes from redis
        msgs = conversation("cross")
        answer, prompt1, _ = chat(r1, msgs)
        msgs = next_turn(msgs, answer, "And what about tomorrow? ")
        answer, prompt2, cached2 = chat(r2, msgs)
        assert cached2 >= prompt1 - 64, (prompt1, prompt2, cached2)

        # a fresh replica joins the router mid-trace and serves its first turn from redis
        fresh = Served(tmp_path, "fresh", free_port(), "--shared-cache", ep["redis"]["url"]).wait_up()
        with httpx.Client(trust_env=False, timeout=10) as c:
            assert c.post(router + "/workers", json={"url": fresh.url}).status_code < 300
            deadline = time.monotonic() + 20
            while len(c.get(router + "/workers").json()["workers"]) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        msgs = next_turn(msgs, answer, "Thank you; one more thing. ")
        _, prompt3, cached3 = chat(fresh.url, msgs)
        assert cached3 >= prompt2 - 64, (prompt2, prompt3, cached3)
        assert fresh.stats()["shared"]["hits"] == 1
        chat(router, conversation("after the join"))  # the router still serves

        # SIGTERM stops the router, the replicas and redis
        pids = [ep["router"]["pid"], ep["redis"]["pid"], *(r["pid"] for r in ep["replicas"])]
        assert stop_process(cluster, 90) == 0
        assert not [p for p in pids if _alive(p)]
        assert "stopped" in (tmp_path / "cluster.txt").read_text()
        with pytest.raises(AssertionError):
            wait_health(router, 0.5)
    finally:
        stop_process(cluster, 90)
        single.stop()
        if fresh is not None:
            fresh.stop()
        err.close()
