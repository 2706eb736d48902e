"""`hpc-cli bench`: seeded traces of every kind, and a replay of a small trace against the three
built-in cache modes on the CPU (builtin:random) that prints the table and writes the report and
the plots."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hpc_cli.bench.generate import KINDS, GenerateConfig, generate, read_trace, write_trace
from hpc_cli.errors import ConfigError

SMALL = dict(sessions=2, turns=3, preamble_tokens=200, user_tokens=(20, 40), answer_tokens=(20, 40), max_tokens=2)


@pytest.mark.parametrize("kind", KINDS)
def test_traces_are_seeded_and_replay_in_session_order(kind, tmp_path):
    a, b = generate(GenerateConfig(kind, seed=3, **SMALL)), generate(GenerateConfig(kind, seed=3, **SMALL))
    assert a == b and a != generate(GenerateConfig(kind, seed=4, **SMALL))
    path = tmp_path / "t.jsonl"
    assert write_trace(a, path) == len(a.requests)
    back = read_trace(path)
    assert back.meta["kind"] == kind and [r.id for r in back.requests] == [r.id for r in a.requests]
    assert back.requests[0].messages == a.requests[0].messages
    sessions = {}
    for r in a.requests:
        sessions.setdefault(r.session, []).append(r)
    system = {r.messages[0]["content"] for r in a.requests}
    assert len(system) == 1  # every kind shares one system preamble
    if kind == "shared-preamble":
        assert len(sessions) == 6 and all(len(s) == 1 for s in sessions.values())
        return
    assert len(sessions) == 2 and all(len(s) == 3 for s in sessions.values())
    assert [r.session for r in a.requests[:2]] == ["s0", "s1"]  # sessions interleave
    for turns in sessions.values():
        for prev, cur in zip(turns, turns[1:]):
            assert len(cur.messages) == len(prev.messages) + 2
            if kind in ("agent-loop", "multi-turn"):  # the history only grows
                assert cur.messages[:len(prev.messages)] == prev.messages
    if kind == "edits":  # some later turn changes an earlier user message
        assert any(cur.messages[1] != prev.messages[1] for t in sessions.values() for prev, cur in zip(t, t[1:]))
    if kind == "agent-loop":
        assert a.requests[0].tools and any(m["role"] == "tool" for m in a.requests[-1].messages)


def test_bad_trace_files_are_config_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match="line 1: no 'messages' list"):
        read_trace(p)
    p.write_text("not json\n")
    with pytest.raises(ConfigError, match="not JSON"):
        read_trace(p)


def test_mode_settings_keep_each_modes_own_table(tmp_path):
    from hpc_cli.bench.settings import mode_settings

    prof = tmp_path / "p.toml"
    prof.write_text("[cache]\nhost_cache_mib = 64\nprefix_cache_file = 'x.bin'\n[cache.hybrid]\nmax_new_taps = 3\n"
                    "[cache.legacy]\nmax_shared_prefixes = 1\n")
    h, l = mode_settings(str(prof), "hybrid", {}), mode_settings(str(prof), "legacy", {"engine.prefill_chunk": 256})
    assert h.effective["cache.hybrid.max_new_taps"] == 3 and h.effective["cache.prefix_cache_file"] is None
    assert l.effective["cache.legacy.max_shared_prefixes"] == 1 and l.effective["engine.prefill_chunk"] == 256
    assert mode_settings(str(prof), "none", {}).settings.cache.mode == "off"


def test_bench_cli_compares_the_modes_and_writes_plots(tmp_path):
    from hpc_cli.cli import cli

    runner = CliRunner()
    trace = tmp_path / "mt.jsonl"
    res = runner.invoke(cli, ["bench", "generate", "--kind", "multi-turn", "--seed", "1", "--sessions", "2",
                              "--turns", "2", "--preamble-tokens", "300", "--user-tokens", "20-40",
                              "--answer-tokens", "20-40", "--max-tokens", "2", str(trace)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    res = runner.invoke(cli, ["bench", str(trace), "--modes", "hybrid,legacy,off", "--out", str(out),
                              "--set", "model.max_model_len=2048", "--set", "engine.max_concurrency=2",
                              "--set", "cache.host_cache_mib=16"])
    assert res.exit_code == 0, res.output
    assert "hpc-cli bench: mt.jsonl (multi-turn)" in res.output and "TTFT p50 ms" in res.output
    doc = json.loads((out / "report.json").read_text())
    s = doc["summary"]
    assert list(s) == ["hybrid", "legacy", "off"] and all(v["requests"] == 4 and v["errors"] == 0 for v in s.values())
    assert s["hybrid"]["reuse_share"] > s["legacy"]["reuse_share"] > 0 == s["off"]["reuse_share"]
    assert s["off"]["prefill_tokens"] == s["off"]["prompt_tokens"]
    assert doc["runs"]["legacy"]["residency"] and doc["runs"]["hybrid"]["cache_stats"]["residency"]["entries"] > 0
    assert doc["settings"]["legacy"]["cache.mode"] == "legacy"
    for name in ("reuse", "ttft", "residency"):
        png = out / f"{name}.png"
        assert doc["plots"][name] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_refuses_bad_flags(tmp_path):
    from hpc_cli.cli import cli

    trace = tmp_path / "t.jsonl"
    write_trace(generate(GenerateConfig("multi-turn", **SMALL)), trace)
    res = CliRunner().invoke(cli, ["bench", str(trace), "--set", "prefill_chunk"])
    assert res.exit_code == 2 and "is not KEY=VALUE" in res.output
    res = CliRunner().invoke(cli, ["bench", "generate", "--kind", "edits", "--user-tokens", "9-3", str(trace)])
    assert res.exit_code == 2 and "MIN <= MAX" in res.output


def test_a_benchmark_document_is_printed_and_written_alike(tmp_path, capsys):
    from hpc_cli.bench.document import emit

    doc = {"benchmark": "x", "runs": {"none": {"decode_tok_s": 1.5}}, "ratio": None}
    emit(doc, tmp_path / "out.json")
    printed = capsys.readouterr().out
    assert json.loads(printed) == doc
    assert (tmp_path / "out.json").read_text() == printed
    emit(doc, None)  # no file asked for: printed only
    assert json.loads(capsys.readouterr().out) == doc
