"""A long prefill is never silent: progress lines every few seconds, and one when it ends."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from hpc_cli.engine import progress
from hpc_cli.engine.api import GenerationRequest, SamplingParams, Usage
from hpc_cli.engine.engine import Engine


def _lane(n_prompt: int):
    return SimpleNamespace(pos=0, n_prompt=n_prompt, usage=Usage(), prefill_started_at=None, prefill_logged_at=None,
                           request=SimpleNamespace(request_id="req-9"))


def test_lines_every_period_and_at_the_end(caplog):
    lane = _lane(4096)
    with caplog.at_level(logging.INFO, logger="hpc_cli.engine"):
        t = 100.0
        for k in range(1, 9):  # eight passes of 512 tokens, 2 s each
            lane.pos = lane.usage.prefill_tokens = 512 * k
            progress.after_prefill_pass(lane, t, t + 2.0)
            t += 2.0
    lines = [r.getMessage() for r in caplog.records if r.name == "hpc_cli.engine"]
    assert lines == ["req-9 prefill 1536/4096 prompt tokens (37%), 6.0 s, 256 tok/s",
                     "req-9 prefill 3072/4096 prompt tokens (75%), 12.0 s, 256 tok/s",
                     "req-9 prefill done 4096/4096 prompt tokens (100%), 16.0 s, 256 tok/s"]


def test_short_prefill_logs_nothing(caplog):
    lane = _lane(512)
    with caplog.at_level(logging.INFO, logger="hpc_cli.engine"):
        lane.pos = lane.usage.prefill_tokens = 512
        progress.after_prefill_pass(lane, 0.0, 0.3)
    assert not [r for r in caplog.records if r.name == "hpc_cli.engine"]


def test_engine_logs_a_long_prefill(model, caplog, monkeypatch):
    monkeypatch.setattr(progress, "PERIOD_S", 0.0)  # every pass counts as long
    e = Engine(model, kv_pages=64, prefill_chunk=64, max_concurrency=1).start()
    try:
        with caplog.at_level(logging.INFO, logger="hpc_cli.engine"):
            e.generate(GenerationRequest(list(range(1, 257)), SamplingParams(max_tokens=1, temperature=0.0),
                                         request_id="long-1"), timeout=120)
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("long-1 prefill")]
    assert [ln.split(" prompt")[0] for ln in lines] == [
        "long-1 prefill 64/256", "long-1 prefill 128/256", "long-1 prefill 192/256", "long-1 prefill done 256/256"]
