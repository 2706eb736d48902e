"""benchmarks/decode_gaps.py on the CPU: a small run of two variants with builtin:tiny gives every
measured request's token gaps per variant and the gaps against off's; bad variants are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_gaps.py"


def test_two_variants_give_each_gap_against_off(tmp_path):
    out = tmp_path / "gaps.json"
    cmd = [sys.executable, str(SCRIPT), "--model", "builtin:tiny", "--preamble", "200", "--sessions", "2",
           "--turns", "2", "--max-tokens", "3", "--kv-pages", "128", "--host-cache-mib", "32",
           "--variants", "off,hybrid", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode_gaps" and set(doc["results"]) == {"off", "hybrid"}
    for v, r in doc["results"].items():
        assert r["requests"] == 2  # 2 sessions x 2 turns, each session's first turn not measured
        assert len(r["gap_p50_ms"]) == 2 and all(g > 0 for g in r["gap_p50_ms"])
        assert r["ttft_p50_ms"] > 0 and r["syncs"] == {}
    off, hybrid = doc["results"]["off"], doc["results"]["hybrid"]
    assert off["gap_vs_off"] == []
    assert hybrid["gap_vs_off"] == [round(a / b, 4) for a, b in zip(hybrid["gap_p50_ms"], off["gap_p50_ms"])]
    assert "hybrid" in proc.stderr  # the table


def test_an_unknown_variant_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--variants", "off,legacy:dma"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "is not off or hybrid" in proc.stderr
