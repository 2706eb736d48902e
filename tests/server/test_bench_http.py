"""`hpc-cli bench --base URL`: a trace replayed against a running server (the real engine,
builtin:random on CPU, behind a live server on 127.0.0.1): cached tokens from the streamed usage,
residency from /v1/cache/stats, the server's own cache mode in the report."""

from __future__ import annotations

import json

from click.testing import CliRunner

from hpc_cli.bench.generate import GenerateConfig, generate, write_trace
from hpc_cli.engine.engine import Engine
from hpc_cli.server.app import create_app
from hpc_cli.settings import load_settings

FLAGS = {"model.name": "builtin:random", "model.device": "cpu", "model.max_model_len": 2048,
         "engine.max_concurrency": 2, "engine.prefill_chunk": 256, "cache.host_cache_mib": 16}


def test_bench_against_a_running_server(serve, tmp_path):
    from hpc_cli.cli import cli

    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    try:
        base = serve(create_app(engine, settings))
        trace = tmp_path / "t.jsonl"
        write_trace(generate(GenerateConfig("shared-preamble", seed=2, sessions=3, turns=1, preamble_tokens=300,
                                            user_tokens=(20, 30), max_tokens=3)), trace)
        out = tmp_path / "out"
        res = CliRunner().invoke(cli, ["bench", str(trace), "--base", base, "--out", str(out), "--concurrency", "2",
                                       "--no-plots"])
        assert res.exit_code == 0, res.output
    finally:
        engine.stop()
    doc = json.loads((out / "report.json").read_text())
    s = doc["summary"]["hybrid"]  # the server's mode, from /v1/cache/stats
    assert s["requests"] == 3 and s["errors"] == 0 and s["cached_tokens"] > 0 and s["ttft_p50_s"] > 0
    reqs = doc["runs"]["hybrid"]["requests"]
    assert all(r["completion_tokens"] == 3 and r["finish_reason"] == "length" for r in reqs)
    assert doc["runs"]["hybrid"]["residency"][-1]["entries"] > 0 and doc["plots"] == {}
