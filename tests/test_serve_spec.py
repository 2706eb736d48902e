"""benchmarks/serve_spec.py on the CPU: speculative decoding through hpc-cli serve and the openai
client, MTP against none in the same run on the embedded model's own chat questions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ports import free_ports

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_spec.py"


def test_mtp_against_none_through_http(tmp_path):
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(SCRIPT), "--backends", "mtp", "--sessions", "1", "--turns", "2", "--max-tokens", "24",
           "--repeat", "1", "--port", str(free_ports(2)), "--serve-args", "--host-cache-mib 64",
           "--log-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "serve_spec" and set(doc["runs"]) == {"none", "mtp"}
    none, mtp = doc["runs"]["none"], doc["runs"]["mtp"]
    assert none["speedup"] == 1.0 and none["decode_tokens"] > 0
    assert mtp["answers_equal_none"] is True  # greedy output does not depend on speculation
    assert mtp["decode_tokens"] == none["decode_tokens"]
    assert mtp["rounds"] > 0 and mtp["tokens_per_round"] > 1.0  # the trained MTP head accepts drafts
    # no k among the flags: the server drafts builtin:tiny's recommended one a round
    assert mtp["k"] == 1 and mtp["tokens_per_round"] <= 2.0
    assert mtp["speedup"] > 0 and mtp["tpot_p50_ms"] > 0 and mtp["ttft_p50_ms"] > 0
    # the server's rounds split into those the round before verified ahead and the others
    assert 0 <= mtp["verify_ahead_rounds"] <= mtp["rounds"]
    assert (mtp["round_ms_other"] or 0) > 0 or (mtp["round_ms_verified_ahead"] or 0) > 0
    assert "mtp" in proc.stderr and "tok/s" in proc.stderr  # the human table


def test_unknown_backend_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backends", "eagle"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "unknown backend" in proc.stderr
