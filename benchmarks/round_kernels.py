"""Kernels a decode step and a speculative round launch on the GPU, and the device's busy time.

On a small model every kernel of a step costs the device a few microseconds whatever its work, so
a speculative round pays off only where its kernels (the verify pass, the proposal, the round's
tail) cost less than the tokens it commits: count them. Per backend (``none`` is plain decoding):
one engine, warmed up as ``hpc-cli serve`` warms it, answers one prompt for ``--max-tokens``
tokens (end of turn ignored) under the torch profiler (CUDA activity only); reported per decode
step or round: wall time, device busy time (the union of the kernels' and copies' intervals),
kernels, and the kernels by name (``--top`` of them), counted and by the device time they take.
The prompt's prefill is inside the window, so the per-round figures carry a small share of it,
the same for every backend.

    python benchmarks/round_kernels.py -k 1
    python benchmarks/round_kernels.py --chat-data .tiny-data -k 3 --backends none,mtp --top 40

Prints one JSON document (and writes it to --out); a table goes to stderr. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_decode import chat_prompts, held_out_prompts, warmed_engine  # noqa: E402

from hpc_cli.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from hpc_cli.model.model import HybridModel  # noqa: E402


def busy_us(intervals: list[tuple[int, int]]) -> float:
    """The union of ``(start, end)`` intervals, in their unit."""
    total, cur = 0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur is not None else 0)


def measure(engine, prompt: list[int], max_tokens: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if engine.spec is not None:
        engine.spec.counters.clear()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        toks, _ = engine.submit(GenerationRequest(list(prompt), sp)).result(timeout=600)
        wall = time.perf_counter() - t0
    rounds = engine.spec.counters["rounds"] if engine.spec is not None else len(toks)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in events])
    names = collections.Counter(e.name for e in events)
    spent = collections.Counter()
    for e in events:
        spent[e.name] += e.time_range.end - e.time_range.start
    return {"tokens": len(toks), "rounds": rounds, "wall_ms_a_round": 1e3 * wall / rounds,
            "busy_ms_a_round": busy / 1e3 / rounds, "kernels_a_round": len(events) / rounds,
            "by_name": {n: round(c / rounds, 2) for n, c in names.most_common(top)},
            "us_a_round_by_name": {n: round(t / rounds, 2) for n, t in spent.most_common(top)}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("-k", type=int, default=1, help="drafts a round")
    ap.add_argument("--backends", default="none,mtp,dflash,dflash2")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chat-data", default=None, metavar="DIR",
                    help="a held-out prompt of the tiny corpus in DIR (scripts/tiny_corpus.py), else a fixed question")
    ap.add_argument("--top", type=int, default=25, help="kernel names listed a backend")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("counts the kernels of a GPU: needs CUDA")
    model = HybridModel.from_name_or_path(args.model, dtype=getattr(torch, args.dtype), device="cuda")
    prompts = held_out_prompts(model, args.chat_data, 4) if args.chat_data else chat_prompts(model, 4)
    eargs = types.SimpleNamespace(concurrency=1, prompt_len=256, max_tokens=args.max_tokens, prefill_chunk=512,
                                  warmup="full", k=args.k, traffic="chat")
    runs = {}
    for b in [x for x in args.backends.split(",") if x]:
        engine = warmed_engine(model, None if b == "none" else b, prompts, eargs)
        try:
            runs[b] = measure(engine, prompts[0], args.max_tokens, args.top)
        finally:
            engine.stop()
    doc = {"benchmark": "round_kernels", "model": args.model, "dtype": args.dtype, "k": args.k,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"k={args.k}: backend | tokens | rounds | wall ms a round | device busy ms a round | kernels a round",
          file=sys.stderr)
    for b, r in runs.items():
        print(f"  {b:8} {r['tokens']:5} {r['rounds']:5} | {r['wall_ms_a_round']:7.3f} | {r['busy_ms_a_round']:7.3f}"
              f" | {r['kernels_a_round']:6.1f}", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
