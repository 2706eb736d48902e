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


def test_runs_of_one_variant_each_merge_into_one_table(tmp_path):
    """As benchmarks/gpu_gaps.sh runs it: a variant a process, each under its --label, then
    --compare merges the documents and sets every gap against the off run's."""
    base = [sys.executable, str(SCRIPT), "--model", "builtin:tiny", "--preamble", "200", "--sessions", "2",
            "--turns", "2", "--max-tokens", "3", "--kv-pages", "128", "--host-cache-mib", "32"]
    for v, label in [("off", "off"), ("hybrid", "hybrid-p4")]:
        proc = subprocess.run([*base, "--variants", v, "--label", label, "--out", str(tmp_path / f"{label}.json")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    merged = tmp_path / "gaps.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(tmp_path / "off.json"),
                           str(tmp_path / "hybrid-p4.json"), "--out", str(merged)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(merged.read_text())
    assert set(doc["results"]) == {"off", "hybrid-p4"} and len(doc["compared"]) == 2
    off, p4 = doc["results"]["off"], doc["results"]["hybrid-p4"]
    assert p4["variant"] == "hybrid" and off["gap_vs_off"] == []
    assert p4["gap_vs_off"] == [round(a / b, 4) for a, b in zip(p4["gap_p50_ms"], off["gap_p50_ms"])]
    assert "hybrid-p4" in proc.stderr  # the table
    # the same document twice: a label in two documents is refused
    proc = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(tmp_path / "off.json"),
                           str(tmp_path / "off.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "in two documents" in proc.stderr


def test_a_label_names_one_variant():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--variants", "off,hybrid", "--label", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--label" in proc.stderr
