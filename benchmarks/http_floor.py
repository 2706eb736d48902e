"""The HTTP floor under every request: what a streamed chat request costs, seen from the official
openai client, when the server has no model behind it, on each event loop.

A bare app (the body read and parsed as JSON, then one role chunk, one content chunk, the finish
chunk and ``[DONE]`` as Server-Sent Events) runs under uvicorn with this server's own connection
settings (:func:`hpc_cli.server.limits.uvicorn_config`: the guarded h11 protocol, TCP_NODELAY),
once per ``--loops`` entry, in a subprocess each; the client sends ``--requests`` chat requests of
about ``--kib`` KiB (a multi-turn conversation's size) and reports the time to the first content
chunk, p50 and p90, for each loop, the loops alternating ``--rounds`` times. A component
benchmark: it explains the part of a turn's TTFT that neither the cache nor the model touches.

    python benchmarks/http_floor.py --loops asyncio,uvloop --rounds 3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

APP = r'''
import json, socket, sys
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
import uvicorn
from hpc_cli.server.limits import uvicorn_config
from hpc_cli.settings import load_settings

async def chat(request: Request):
    body = json.loads(await request.body())
    base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
    chunks = [{"delta": {"role": "assistant", "content": ""}}, {"delta": {"content": "hi"}},
              {"delta": {}, "finish_reason": "length"}]
    async def events():
        for c in chunks:
            yield "data: " + json.dumps({**base, "choices": [{"index": 0, **c}]}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
sock = socket.socket(); sock.bind(("127.0.0.1", int(sys.argv[2]))); sock.listen(64)
server = load_settings(None, {"server.event_loop": sys.argv[1]}, environ={}).settings.server
uvicorn.Server(uvicorn_config(app, server, log_level="warning", lifespan="off")).run(sockets=[sock])
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _messages(kib: int) -> list[dict[str, str]]:
    words = "the quick brown fox jumps over the lazy dog while the cache keeps every block ".split()
    text = " ".join(words[i % len(words)] for i in range(kib * 1024 // 5))
    turns = 8
    size = len(text) // turns
    out = [{"role": "system", "content": text[:size]}]
    for i in range(1, turns):
        out.append({"role": "user" if i % 2 else "assistant", "content": text[i * size:(i + 1) * size]})
    return out


def one_loop(loop: str, requests: int, kib: int) -> list[float]:
    import httpx
    import openai

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", APP, loop, str(port)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m"}, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        messages = _messages(kib)
        ttfts = []
        for i in range(requests + 5):
            msgs = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + f" {i}"}]
            t0 = time.perf_counter()
            first = None
            with client.chat.completions.create(model="m", messages=msgs, max_tokens=1, stream=True) as stream:
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
            if i >= 5:  # the connection's and the client's first uses left out
                ttfts.append(first)
        return ttfts
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", default="asyncio,uvloop")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--kib", type=int, default=23, help="request body size (a multi-turn chat's)")
    ap.add_argument("--rounds", type=int, default=2, help="the loops alternate this many times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    loops = [x for x in args.loops.split(",") if x]
    seen: dict[str, list[float]] = {loop: [] for loop in loops}
    for _ in range(args.rounds):
        for loop in loops:
            seen[loop] += one_loop(loop, args.requests, args.kib)
    result = {"benchmark": "http_floor", "kib": args.kib, "requests": args.requests, "rounds": args.rounds,
              "loops": {loop: {"ttft_p50_ms": round(1e3 * statistics.median(v), 3),
                               "ttft_p90_ms": round(1e3 * statistics.quantiles(v, n=10)[-1], 3)}
                        for loop, v in seen.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
