"""Regenerate the fixture stats (a tiny builtin model on the CPU): ``python tests/tui/make_fixtures.py``.

``idle.json`` is ``engine.stats()`` as ``/v1/cache/stats`` serves it, after a few requests;
``busy.json`` is taken while requests run and wait, with the rows and names the in-process view
adds (``cache.top_snapshots``, ``cache.inflight``, ``settings``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine
from hpc_cli.settings import load_settings
from hpc_cli.tui.collect import engine_source

HERE = Path(__file__).parent / "fixtures"


def main() -> None:
    r = load_settings(None, {"cache.host_cache_mib": 64, "engine.prefill_chunk": 128,
                             "engine.max_concurrency": 2}, environ={})
    e = Engine.from_settings(r).start()
    p = list(range(10, 250)) * 3
    for extra in ([], [1, 2, 3], [4, 5, 6, 7] * 20):
        e.generate(GenerationRequest(p + extra, SamplingParams(max_tokens=12, temperature=0)))
    time.sleep(0.5)
    idle = e.stats()
    handles = [e.submit(GenerationRequest(p[: 300 + 40 * i] + [i + 1] * 70, SamplingParams(max_tokens=40, temperature=0)))
               for i in range(6)]
    read = engine_source(e, r)
    busy = None
    deadline = time.time() + 60
    while time.time() < deadline:
        s = read()
        if s["requests"]["running"] >= 2 and s["requests"]["waiting"] >= 1:
            busy = s
            break
        time.sleep(0.05)
    for h in handles:
        h.result(timeout=120)
    e.stop()
    if busy is None:
        sys.exit("never saw a busy engine")
    HERE.mkdir(exist_ok=True)
    for name, s in (("idle", idle), ("busy", busy)):
        (HERE / f"{name}.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
        print(name, s["requests"], s["cache"]["pool"])


if __name__ == "__main__":
    main()
