"""The engine stats the terminal view reads are also Prometheus gauges (hpc_engine_<path>): the
speculative and expert-tier numbers are there, the per-snapshot rows and TTFT samples are not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hpc_cli.server.metrics import Metrics, flatten_stats

FIX = Path(__file__).parent / "fixtures"


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?", name), line
            assert name not in out, f"{name} twice"
            out[name] = float(value)
    return out


def test_spec_and_expert_stats_are_gauges():
    s = json.loads((FIX / "spec_moe.json").read_text())
    got = _samples(Metrics().render(s))
    sp, ex = s["speculative"], s["experts"]
    for key in ("acceptance_rate", "mean_acceptance_length", "rounds", "draft_tokens", "accepted_draft_tokens", "k"):
        assert got[f"hpc_engine_speculative_{key}"] == pytest.approx(sp[key])
    for key in ("slots", "resident", "hit_rate", "host_bytes_per_token", "host_bytes", "tokens"):
        assert got[f"hpc_engine_experts_{key}"] == pytest.approx(ex[key])
    assert got["hpc_engine_cache_inflight_write_bytes"] == s["cache"]["inflight"]["write_bytes"]
    for name in got:
        assert "top_snapshots" not in name and "ttft_recent_s" not in name
    assert "hpc_engine_settings_kv_profile" not in got  # strings are not gauges


@pytest.mark.parametrize("name", ["idle", "busy", "spec_moe"])
def test_flatten_leaves_rows_out(name):
    s = json.loads((FIX / f"{name}.json").read_text())
    assert s["cache"]["top_snapshots"] and s["ttft_recent_s"]
    flat = flatten_stats(s)
    assert flat and not any("top_snapshots" in k or "ttft_recent" in k for k in flat)
    assert flat["hpc_engine_cache_pool_free"] == s["cache"]["pool"]["free"]
