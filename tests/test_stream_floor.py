"""benchmarks/stream_floor.py: this server's app over a paced engine double, streamed to the
openai client; every token arrives as its own content chunk, whichever hand-off and burst."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_floor.py"


def test_both_handoffs_stream_every_token(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [sys.executable, str(SCRIPT), "--burst", "2", "--work-us", "20", "--wait-us", "20", "--tokens", "41",
           "--requests", "1", "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "stream_floor" and set(doc["runs"]) == {"early", "late"}
    for runs in doc["runs"].values():
        (r,) = runs
        assert r["content_chunks"] == 41  # the tokens put together still go out as one chunk each
        assert r["client_tok_s"] > 0 and r["step_us"] > 0
    assert doc["bare_step_us"] > 0
