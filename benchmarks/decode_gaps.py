"""Each decode step of a request after its prefill, per cache mode and copy method, in one process.

Through HTTP (``serve_trace.py``, ``ratios.*.itl_p50_by_gap``) the hybrid mode's gap between a
request's first and second token was 0.4-0.6 ms longer than the cache-off mode's on an H100,
every later gap equal: the first decode step is the one during which the host runs the last
prefill pass's block commits and taps, and the device copies the prompt's new blocks and state
to the host tier. This benchmark isolates that step without the server: one model, one engine
per variant in turn (``--variants``: ``off``, ``hybrid`` and ``hybrid:dma``/``hybrid:kernel``,
the transfer engine's and the taps' copy method, ``[cache] transfer_copy``), the same seeded
multi-turn prompts (sessions sharing a preamble, each turn the history plus a new message of
varied length), one request at a time, greedy; per variant the TTFT p50 and each token gap's
p50 over the measured turns (a session's first turn excluded), and the gaps against ``off``'s.
``--sync-debug`` runs new sessions of the same shape through the last hybrid variant after its
timed turns, under ``torch.cuda.set_sync_debug_mode("warn")``, and counts the engine's stacks that
made the host wait for the device (CUDA only).

    python benchmarks/decode_gaps.py                                   # CUDA: the 27B widths
    python benchmarks/decode_gaps.py --model builtin:tiny --preamble 600 --turns 3
    bash benchmarks/gpu_gaps.sh OUT                                    # a variant a process, merged

``--label`` names a one-variant run's result; ``--compare JSON...`` measures nothing and merges such
runs' documents, every gap against the off run's.

Prints one JSON document (and writes it to --out); a table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hpc_cli.bench.document import emit
from hpc_cli.engine.api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from hpc_cli.engine.engine import Engine
from hpc_cli.model import HybridModel


@dataclass
class VariantResult:
    variant: str
    startup_s: float
    requests: int
    ttft_p50_ms: float
    gap_p50_ms: list[float]  # gap j: between tokens j and j + 1, p50 over the measured requests
    #: with --sync-debug: the engine stacks (innermost hpc_cli frames) that waited for the device
    syncs: dict[str, int] = field(default_factory=dict)


def prompts(seed: int, sessions: int, turns: int, preamble: int, vocab: int) -> list[tuple[int, list[int]]]:
    """``(session, prompt)`` in the order sent: turn t of every session before turn t + 1; each
    turn the session's history, then 8 tokens standing for the last answer and a new message of
    200-700 tokens (a fifth of that for short preambles)."""
    rng = random.Random(seed)
    hi = max(100, min(vocab - 1, 5000))
    tok = lambda: rng.randrange(100, hi)  # noqa: E731
    pre = [tok() for _ in range(preamble)]
    scale = 1 if preamble >= 2000 else 5
    hist = {s: pre + [tok() for _ in range(60)] for s in range(sessions)}
    out = []
    for _ in range(turns):
        for s in range(sessions):
            hist[s] = hist[s] + [tok() for _ in range(rng.randrange(200, 700) // scale)]
            out.append((s, list(hist[s])))
            hist[s] = hist[s] + [tok() for _ in range(8)]
    return out


def run(e: Engine, reqs: list[tuple[int, list[int]]], max_tokens: int) -> list[tuple[float, list[float]]]:
    """Each request's (TTFT, gaps between its tokens), in seconds, at the consumer."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for _, p in reqs:
        t0 = time.perf_counter()
        h = e.submit(GenerationRequest(p, sp))
        ts = []
        for ev in h.events(timeout=600):
            if isinstance(ev, TokenEvent):
                ts.append(time.perf_counter())
            elif isinstance(ev, FinishEvent):
                if ev.error:
                    raise SystemExit(f"decode_gaps: a request failed: {ev.error}")
                break
        out.append((ts[0] - t0, [b - a for a, b in zip(ts, ts[1:])]))
    return out


def engine_for(model, variant: str, args) -> Engine:
    mode, _, copy = variant.partition(":")
    kw: dict[str, object] = dict(cache_mode=mode)
    if copy:
        kw["transfer_copy"] = copy
    return Engine(model, kv_pages=args.kv_pages, max_concurrency=1, prefill_chunk=args.prefill_chunk,
                  kv_profile=args.kv_profile, host_cache_mib=args.host_cache_mib if mode != "off" else 0,
                  **kw).start()


class SyncStacks:
    """Counts the engine's stacks at each warning of CUDA's sync debug mode."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._show = warnings.showwarning

    def __enter__(self) -> "SyncStacks":
        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack() if "hpc_cli" in f.filename]
            key = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}:{f.lineno}" for f in reversed(frames[-5:]))
            self.counts[key] = self.counts.get(key, 0) + 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show
        warnings.resetwarnings()


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", default="builtin:qwen3.5-27b-shape@8" if cuda else "builtin:tiny")
    ap.add_argument("--variants", default="off,hybrid,hybrid:dma",
                    help="comma-separated MODE[:COPY], COPY one of auto, dma, kernel ([cache] transfer_copy)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--preamble", type=int, default=2200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-profile", default="int8-g64")
    ap.add_argument("--kv-pages", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--host-cache-mib", type=int, default=4096)
    ap.add_argument("--sync-debug", action="store_true", help="count the stacks that wait for the device (CUDA)")
    ap.add_argument("--label", default=None, help="the result's name in the document (one variant only)")
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: merge these runs' documents, each gap against the off run's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.label is not None and "," in args.variants:
        ap.error("--label names one variant's result: give --variants one variant")
    for v in args.variants.split(","):
        mode, _, copy = v.partition(":")
        if mode not in ("off", "hybrid") or copy not in ("", "auto", "dma", "kernel"):
            ap.error(f"--variants: {v!r} is not off or hybrid[:auto|dma|kernel]")
    if args.turns < 2:
        ap.error("--turns: at least 2 (a session's first turn is not measured)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compare:
        doc = compare(args.compare)
        print_table(doc["results"])
        emit(doc, args.out)
        return doc
    cuda = torch.cuda.is_available()
    model = HybridModel.from_name_or_path(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                          device="cuda" if cuda else "cpu")
    vocab = model.config.vocab_size
    variants = args.variants.split(",")
    last_hybrid = max((i for i, v in enumerate(variants) if v.startswith("hybrid")), default=-1)
    results: dict[str, VariantResult] = {}
    for i, v in enumerate(variants):
        t = time.perf_counter()
        e = engine_for(model, v, args)
        e.warmup()
        startup = time.perf_counter() - t
        try:
            run(e, prompts(99, args.sessions, 1, args.preamble, vocab), args.max_tokens)  # the pools' first use
            reqs = prompts(1, args.sessions, args.turns, args.preamble, vocab)
            timed = run(e, reqs, args.max_tokens)
            syncs: dict[str, int] = {}
            if args.sync_debug and cuda and i == last_hybrid:
                # after the timed turns (the warnings' stacks cost host time): new sessions of
                # the same shape, so their later turns reuse as the timed ones did
                with SyncStacks() as s:
                    run(e, prompts(2, args.sessions, args.turns, args.preamble, vocab), args.max_tokens)
                syncs = dict(sorted(s.counts.items(), key=lambda kv: -kv[1]))
        finally:
            e.stop()
        later = timed[args.sessions:]  # each session's first turn reuses only the preamble
        n = min(len(g) for _, g in later)
        results[v] = VariantResult(
            v, round(startup, 2), len(later), round(statistics.median(t for t, _ in later) * 1e3, 3),
            [round(statistics.median(g[j] for _, g in later) * 1e3, 3) for j in range(n)], syncs=syncs)
        del e
        if cuda:
            torch.cuda.empty_cache()
    doc = {"benchmark": "decode_gaps", "model": args.model,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "config": {k: getattr(args, k) for k in ("sessions", "turns", "preamble", "max_tokens", "kv_profile",
                                                      "prefill_chunk", "host_cache_mib")},
           "results": against_off({args.label or k: asdict(r) for k, r in results.items()})}
    print_table(doc["results"])
    emit(doc, args.out)
    return doc


def against_off(results: dict[str, dict]) -> dict[str, dict]:
    """``results`` (label -> a :class:`VariantResult` as a dict) with each one's gaps against the
    ``off`` entry's (``gap_vs_off``; empty for off itself or without an off entry)."""
    base = results.get("off")
    for label, r in results.items():
        r["gap_vs_off"] = ([_ratio(a, b) for a, b in zip(r["gap_p50_ms"], base["gap_p50_ms"])]
                           if base is not None and label != "off" else [])
    return results


def print_table(results: dict[str, dict]) -> None:
    for label, r in results.items():
        gaps = " ".join(f"{x:.3f}" for x in r["gap_p50_ms"])
        print(f"{label:14} TTFT p50 {r['ttft_p50_ms']:8.2f} ms  gaps {gaps}  vs off {r['gap_vs_off']}",
              file=sys.stderr)
        for k, c in list(r["syncs"].items())[:10]:
            print(f"    sync x{c}: {k}", file=sys.stderr)


def compare(paths: list[str]) -> dict:
    """The results of several runs (a variant a process, as ``benchmarks/gpu_gaps.sh`` runs them)
    as one document, each under its label, every gap against the ``off`` run's."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    results: dict[str, dict] = {}
    for p, d in zip(paths, docs):
        if d.get("benchmark") != "decode_gaps":
            raise SystemExit(f"decode_gaps: {p} is not a decode_gaps document")
        for label, r in d["results"].items():
            if label in results:
                raise SystemExit(f"decode_gaps: {label!r} is in two documents (give each run its own --label)")
            results[label] = r
    return {"benchmark": "decode_gaps", "model": docs[0]["model"], "device": docs[0]["device"],
            "config": docs[0]["config"], "compared": list(paths), "results": against_off(results)}


if __name__ == "__main__":
    main()
