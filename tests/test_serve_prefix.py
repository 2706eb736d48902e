"""benchmarks/serve_prefix.py on the CPU: raw prompts sharing an unmarked prefix through
/v1/completions and the openai client, the hybrid server against the cache-off one in the same
run: from the third prompt on the hybrid server resumes at the shared prefix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ports import free_ports

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_prefix.py"


def test_shared_prefix_reused_through_completions(tmp_path):
    out = tmp_path / "prefix.json"
    port = free_ports(2)  # hybrid, off
    cmd = [sys.executable, str(SCRIPT), "--requests", "4", "--prefix-words", "250", "--question-words", "80,120",
           "--max-tokens", "4", "--port", str(port), "--serve-args", "--host-cache-mib 64",
           "--log-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    hybrid, off = doc["runs"]["hybrid"], doc["runs"]["off"]
    assert off["cached_tokens"] == [0, 0, 0, 0]
    # the second prompt finds the prefix's blocks but no state where it leaves them, and taps it
    assert hybrid["cached_tokens"][:2] == [0, 0], hybrid
    shared = hybrid["cached_tokens"][2]
    assert shared >= 192 and shared % 64 == 0 and hybrid["cached_tokens"][3] == shared, hybrid
    assert doc["answers_equal"] is True
    assert doc["reuse_share_after_two"] > 0.5
    assert "hybrid / off TTFT p50" in proc.stderr  # the human lines
