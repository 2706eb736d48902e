"""Shared prefixes through /v1/completions, as a user meets them: `hpc-cli serve` in the hybrid
cache mode and with the cache off, raw prompts that share a long prefix nothing marks (a fixed
instruction block and examples, then a varied question: few-shot completions, a RAG template),
streamed through the official openai client, TTFT against the cache-off server in the same run.

Both servers are started on their own ports and kept up; the seeded prompts go to each in turn
(hybrid, off, hybrid, off, ...), one request at a time, greedy. A prompt is the shared prefix
(``--prefix-words`` words of seeded text) followed by its own question of ``--question-words``
MIN,MAX words. Per mode: TTFT p50/p95 over the requests after the first two (the cache's first
request has nothing to reuse; the second finds the prefix's blocks but no state where it leaves
them), cached_tokens per request from the usage, and whether every completion equals off's.

    python benchmarks/serve_prefix.py                                   # builtin:tiny
    python benchmarks/serve_prefix.py --model DIR --requests 24 --serve-args '--kv-profile int8-g64'

Prints one JSON document (and writes it to --out); a table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_trace import ManagedServer, openai_client, percentile  # noqa: E402

MODES = ("hybrid", "off")
WORDS = ("the module returns a value for each item in the list when the function is called with a "
         "default argument and the result is written to the file or printed on the screen so that "
         "every line of the input is read once and the errors are raised as exceptions").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def prompts(n: int, prefix_words: int, question_words: tuple[int, int], seed: int) -> list[str]:
    """The shared prefix, then each request's own question (seeded lengths)."""
    rng = random.Random(seed)
    prefix = "Instructions and examples:\n" + text(rng, prefix_words) + "\n\nQuestion: "
    return [prefix + text(rng, rng.randint(*question_words)) + "\nAnswer:" for _ in range(n)]


def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    out = ""
    usage = None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if ttft is None and (choice.text or choice.finish_reason):
                ttft = time.perf_counter() - t0
            out += choice.text or ""
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    return {"ttft_s": ttft, "text": out, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": cached}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prefix-words", type=int, default=600)
    ap.add_argument("--question-words", default="10,120", help="MIN,MAX words of each request's question")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra flags for both servers, one string")
    ap.add_argument("--port", type=int, default=8341, help="the hybrid server's port (off takes the next)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.question_words.split(","))
    except ValueError:
        raise SystemExit("--question-words wants MIN,MAX") from None
    if not 1 <= lo <= hi or args.requests < 3 or args.prefix_words < 1 or args.max_tokens < 1:
        raise SystemExit("need 1 <= MIN <= MAX question words, --requests >= 3, --prefix-words and --max-tokens >= 1")
    plan = prompts(args.requests, args.prefix_words, (lo, hi), args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_prefix-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ManagedServer] = {}
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for i, mode in enumerate(MODES):
            print(f"serve_prefix: starting hpc-cli serve --cache-mode {mode} ...", file=sys.stderr, flush=True)
            s = ManagedServer(mode, args.model, shlex.split(args.serve_args), args.port + i, log_dir,
                              args.startup_timeout, 60.0)
            s.start()
            servers[mode] = s
        clients, names = {}, {}
        for m, s in servers.items():
            clients[m], names[m] = openai_client(s.url)
        for m in MODES:  # the client's and the connection's first use, on a prompt of its own
            one(clients[m], names[m], "Warm-up.", 1)
        for p in plan:
            for m in MODES:
                results[m].append(one(clients[m], names[m], p, args.max_tokens))
    finally:
        for s in servers.values():
            s.stop()
    runs = {}
    for m in MODES:
        rows = results[m]
        later = [r["ttft_s"] for r in rows[2:]]
        runs[m] = {"ttft_p50_ms": round(1e3 * statistics.median(later), 2),
                   "ttft_p95_ms": round(1e3 * percentile(later, 0.95), 2),
                   "ttft_first_two_ms": [round(1e3 * r["ttft_s"], 2) for r in rows[:2]],
                   "cached_tokens": [r["cached_tokens"] for r in rows],
                   "prompt_tokens": [r["prompt_tokens"] for r in rows]}
    h, o = runs["hybrid"], runs["off"]
    doc = {"benchmark": "serve_prefix", "model": args.model, "serve_args": args.serve_args,
           "requests": args.requests, "prefix_words": args.prefix_words, "question_words": [lo, hi],
           "max_tokens": args.max_tokens, "runs": runs,
           "ttft_p50_ratio": round(h["ttft_p50_ms"] / o["ttft_p50_ms"], 3),
           "reuse_share_after_two": round(sum(h["cached_tokens"][2:]) / sum(h["prompt_tokens"][2:]), 3),
           "answers_equal": [a["text"] for a in results["hybrid"]] == [b["text"] for b in results["off"]],
           "servers": {m: {"startup_s": s.info.startup_s} for m, s in servers.items()}}
    for m in MODES:
        r = runs[m]
        print(f"{m:7s} TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p95 {r['ttft_p95_ms']:8.1f} ms  "
              f"cached_tokens {r['cached_tokens']}", file=sys.stderr)
    print(f"hybrid / off TTFT p50 {doc['ttft_p50_ratio']}, reuse after two {doc['reuse_share_after_two']}, "
          f"answers equal {doc['answers_equal']}", file=sys.stderr)
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
