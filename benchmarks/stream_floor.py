"""What streaming a token costs the engine: this server's own app over a paced engine double,
seen from the official openai client.

Each step of the double holds the interpreter for ``--work-us`` (the host's launches and
bookkeeping, in slices that give the interpreter up as torch's ops do), then waits
``--wait-us`` without it (the device computing the step), and emits ``--burst`` tokens (1 for a
decode step, 1.5-2 for a speculative round). ``--handoff`` says when the step hands the server
the tokens of the step before: ``early`` right after its launch, before the host work, or
``late`` after it, just before the wait (what the engine does, ``hpc_cli/engine/decode_step.py``).
The server (``create_app`` under uvicorn with this server's connection settings, in a
subprocess) streams a long answer to the client; the double's step time is measured on its
thread against the same steps run with nothing served. A component benchmark: it explains the
part of a decode step that the HTTP path adds, not a figure of the model.

    python benchmarks/stream_floor.py --burst 1 --work-us 100 --wait-us 200 --handoff early,late
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc_cli.bench.document import emit

ROOT = Path(__file__).resolve().parents[1]

SERVER = r'''
import json, socket, sys, time
sys.path[:0] = sys.argv[1].split(":")
from fake_engine import FakeEngine
from stream_floor import hold, wait
from hpc_cli.engine.api import AdmittedEvent, FinishEvent, FinishReason, TokenEvent, Usage
from hpc_cli.server.app import create_app
from hpc_cli.server.limits import uvicorn_config
from hpc_cli.settings import load_settings
import uvicorn

port, burst, work_us, wait_us, handoff, loop, log = sys.argv[2:9]
burst, work_us, wait_us = int(burst), float(work_us), float(wait_us)


class Paced(FakeEngine):
    def _run(self, handle):
        req = handle.request
        handle.put(AdmittedEvent(reuse_tokens=0, cached_prefix_tokens=0))
        n, held, steps, t0 = 0, [], 0, time.perf_counter()
        while n < req.sampling.max_tokens:
            if handoff == "early":
                for ev in held:
                    handle.put(ev)
                held = []
            hold(work_us)
            if handoff == "late":
                for ev in held:
                    handle.put(ev)
                held = []
            wait(wait_us)
            for _ in range(min(burst, req.sampling.max_tokens - n)):
                held.append(TokenEvent(token_id=self.text_ids[n % len(self.text_ids)]))
                n += 1
            steps += 1
        for ev in held:
            handle.put(ev)
        with open(log, "a") as f:
            f.write(json.dumps({"step_us": 1e6 * (time.perf_counter() - t0) / steps}) + "\n")
        with self._lock:
            self._active.remove(handle)
        handle.put(FinishEvent(FinishReason.LENGTH, Usage(prompt_tokens=len(req.prompt_tokens), completion_tokens=n)))


settings = load_settings(None, {"server.event_loop": loop}, environ={})
sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(port))); sock.listen(64)
app = create_app(Paced().start(), settings)
uvicorn.Server(uvicorn_config(app, settings.settings.server, log_level="warning", lifespan="off")).run(sockets=[sock])
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hold(us: float) -> None:
    """Python work for ``us`` microseconds that gives the interpreter up every few microseconds,
    as torch's ops do (the host's part of a step)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        for _ in range(20):
            pass
        time.sleep(0)


def wait(us: float) -> None:
    """``us`` microseconds holding no interpreter (the device's part of a step)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        time.sleep(0)


def bare_step_us(work_us: float, wait_us: float, steps: int = 400) -> float:
    """The double's step with nothing served (the same hold and wait, in this process)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        hold(work_us)
        wait(wait_us)
    return 1e6 * (time.perf_counter() - t0) / steps


def run(handoff: str, args, log: Path) -> dict:
    import openai

    port = _free_port()
    log.unlink(missing_ok=True)
    paths = f"{ROOT / 'tests' / 'server'}:{ROOT / 'benchmarks'}"  # the engine double; hold and wait
    proc = subprocess.Popen([sys.executable, "-c", SERVER, paths, str(port), str(args.burst),
                             str(args.work_us), str(args.wait_us), handoff, args.loop, str(log)])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("stream_floor: the server did not start")
                time.sleep(0.1)
        rates, chunks = [], 0
        for _ in range(args.requests):
            first = last = None
            chunks = 0
            stream = client.chat.completions.create(
                model="builtin:random", messages=[{"role": "user", "content": "hi"}], max_tokens=args.tokens,
                temperature=0, stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
            rates.append((args.tokens - 1) / (last - first))
    finally:
        proc.terminate()
        proc.wait()
    steps = [json.loads(line)["step_us"] for line in log.read_text().splitlines()]
    return {"client_tok_s": round(max(rates), 1), "step_us": round(statistics.median(steps), 1),
            "content_chunks": chunks}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=1, help="tokens a step")
    ap.add_argument("--work-us", type=float, default=100.0, help="host work a step (interpreter held)")
    ap.add_argument("--wait-us", type=float, default=200.0, help="device time a step (interpreter free)")
    ap.add_argument("--handoff", default="early,late", help="early, late, or both (compared)")
    ap.add_argument("--tokens", type=int, default=600, help="tokens an answer")
    ap.add_argument("--requests", type=int, default=5, help="answers a configuration (its fastest counts)")
    ap.add_argument("--rounds", type=int, default=2, help="the hand-offs alternate this many times")
    ap.add_argument("--loop", default="auto", help="[server] event_loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    handoffs = [h for h in args.handoff.split(",") if h]
    if any(h not in ("early", "late") for h in handoffs):
        raise SystemExit("--handoff takes early, late or both")
    log = Path(tempfile.mkdtemp(prefix="stream_floor-")) / "steps.jsonl"
    results: dict[str, list[dict]] = {h: [] for h in handoffs}
    for _ in range(args.rounds):
        for h in handoffs:
            results[h].append(run(h, args, log))
    bare = bare_step_us(args.work_us, args.wait_us)
    doc = {"benchmark": "stream_floor", "burst": args.burst, "work_us": args.work_us, "wait_us": args.wait_us,
           "loop": args.loop, "bare_step_us": round(bare, 1), "runs": results}
    for h, rs in results.items():
        best = max(rs, key=lambda r: r["client_tok_s"])
        print(f"handoff {h:5s}: client {best['client_tok_s']:8.1f} tok/s, step "
              f"{statistics.median(r['step_us'] for r in rs):7.1f} us (bare {bare:.1f})", file=sys.stderr)
    emit(doc, args.out)
    return doc


if __name__ == "__main__":
    main()
