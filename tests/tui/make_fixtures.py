"""Regenerate the fixture stats (tiny builtin models on the CPU): ``python tests/tui/make_fixtures.py``.

Each file is ``engine.stats()`` exactly as ``/v1/cache/stats`` serves it (``cache.top_snapshots``,
``cache.inflight`` and ``settings`` included):

- ``idle.json``: after a few requests that share a prefix (snapshots, reuse, host slabs);
- ``busy.json``: while requests run and wait (two lanes, six requests);
- ``spec_moe.json``: ``builtin:tiny-moe`` with the ``mtp`` speculative backend and the MoE expert
  tier on (the ``speculative`` and ``experts`` sections).

The tests derive the older shapes (no rows, no settings) by deleting keys.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine
from hpc_cli.settings import load_settings

HERE = Path(__file__).parent / "fixtures"
PROMPT = list(range(10, 250)) * 3


def _warm(e: Engine, n: int = 12) -> None:
    for extra in ([], [1, 2, 3], [4, 5, 6, 7] * 20):
        e.generate(GenerationRequest(PROMPT + extra, SamplingParams(max_tokens=n, temperature=0)))
    time.sleep(0.5)  # the worker publishes stats a few times a second


def default_fixtures() -> dict[str, dict]:
    r = load_settings(None, {"cache.host_cache_mib": 64, "engine.prefill_chunk": 128,
                             "engine.max_concurrency": 2}, environ={})
    e = Engine.from_settings(r).start()
    _warm(e)
    idle = e.stats().to_json()
    handles = [e.submit(GenerationRequest(PROMPT[: 300 + 40 * i] + [i + 1] * 70,
                                          SamplingParams(max_tokens=40, temperature=0))) for i in range(6)]
    busy = None
    deadline = time.time() + 60
    while time.time() < deadline:
        s = e.stats().to_json()
        if s["requests"]["running"] >= 2 and s["requests"]["waiting"] >= 1 and s["cache"]["top_snapshots"]:
            busy = s
            break
        time.sleep(0.05)
    for h in handles:
        h.result(timeout=120)
    e.stop()
    if busy is None:
        sys.exit("never saw a busy engine")
    return {"idle": idle, "busy": busy}


def spec_moe_fixture() -> dict:
    r = load_settings(None, {"model.name": "builtin:tiny-moe", "cache.host_cache_mib": 16,
                             "experts.offload": True, "experts.budget_slots": 24,
                             "experts.admission": "first-routed", "speculative.backend": "mtp"}, environ={})
    e = Engine.from_settings(r).start()
    _warm(e, 16)
    s = e.stats().to_json()
    e.stop()
    assert "speculative" in s and "experts" in s, sorted(s)
    return s


def main() -> None:
    out = default_fixtures()
    out["spec_moe"] = spec_moe_fixture()
    HERE.mkdir(exist_ok=True)
    for name, s in out.items():
        (HERE / f"{name}.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
        print(name, s["requests"], s["cache"]["pool"], len(s["cache"]["top_snapshots"]), "rows")


if __name__ == "__main__":
    main()
