"""Where a decode step's time goes, for one or more checkpoints side by side (bf16 against its FP8
copy, say): a lane per batch row with a ``--context``-token prefix, then

* ``loop_ms``: a step as benchmarks/model_throughput.py times it (the tokens read back from the
  device each step, the index built, the graph replayed);
* ``engine_ms``: a step as the engine runs it (greedy tokens read back, the next step's index
  built ahead while the device runs, :meth:`HybridModel.prepare_decode`);
* ``graph_ms``: the step's CUDA graph replayed back to back, timed with CUDA events: the device's
  own time, what the host adds being the difference;
* the graph's kernels under the torch profiler (it sees a replay's kernels): device ms a step per
  kernel, the top ``--top``, and sums by kind (quantized products, narrow products, cuBLAS products,
  the rest), ``gaps_ms`` being the step's device time not inside any kernel.

A component benchmark: it explains decode figures, it does not prove them.

    python benchmarks/profile_decode.py --model /ck/bf16 --model /ck/fp8 --batch 1 --context 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hpc_cli.bench.document import emit

KINDS = (("fp8/nvfp4 products", ("_fp8_rows_kernel", "_nvfp4_rows_kernel")),
         ("narrow products", ("_narrow_rows_kernel",)),
         ("cuBLAS products", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitKreduce")),
         ("gdn", ("gdn", "delta", "conv")),
         ("attention", ("attention", "paged")),
         ("norms", ("rms", "norm")))


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def profile_model(path: str, args) -> dict:
    from hpc_cli.model import HybridModel

    model = HybridModel.from_name_or_path(path, dtype=args.dtype, device="cuda", quantized_weights="held",
                                          merge=not args.no_merge)
    b, ctx, steps = args.batch, args.context, args.steps
    pages = (ctx + 3 * steps + 70) // 64 + 1
    kv = model.new_kv_storage(args.kv_profile, pages * b)
    states = model.new_state_slots(b)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (b, ctx + 3 * steps + 8), generator=gen)
    for lane in range(b):
        states.reset(lane)
        model.prefill(prompt[lane, :ctx].cuda(), 0, tables[lane], lane, kv, states)
    slots = list(range(b))
    pos = ctx

    def tables_at(p: int) -> list[list[int]]:
        return [t[:p // 64 + 1] for t in tables]

    # warm-up: the eager step, the capture, a replay
    for _ in range(3):
        model.decode(prompt[:, pos].tolist(), [pos] * b, tables_at(pos), slots, kv, states)
        pos += 1
    torch.cuda.synchronize()

    # as benchmarks/model_throughput.py: the step's tokens on the device, read back by decode
    dev = prompt.cuda()
    t = time.perf_counter()
    for _ in range(steps):
        model.decode(dev[:, pos], [pos] * b, tables_at(pos), slots, kv, states)
        pos += 1
    torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - t) * 1e3 / steps

    # as the engine: greedy tokens read back, the next index built while the device runs
    tokens = prompt[:, pos].tolist()
    prepared = None
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(tokens, [pos] * b, tables_at(pos), slots, kv, states, prepared=prepared)
        prepared = model.prepare_decode([pos + 1] * b, tables_at(pos + 1), slots, kv, states)
        tokens = torch.argmax(logits, dim=-1).tolist()
        pos += 1
    torch.cuda.synchronize()
    engine_ms = (time.perf_counter() - t) * 1e3 / steps

    graphs = model.column_graphs(kv)
    assert graphs is not None and graphs.graphs, "decode runs no CUDA graph here"
    entry = next(reversed(graphs.graphs.values()))
    runs = []
    for _ in range(args.repeat):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            entry.graph.replay()
        z.record()
        z.synchronize()
        runs.append(a.elapsed_time(z) / steps)
    graph_ms = statistics.median(runs)

    from torch.profiler import ProfilerActivity, profile

    n_prof = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            entry.graph.replay()
        torch.cuda.synchronize()
    per = {e.key: (e.device_time_total / 1000 / n_prof, e.count / n_prof) for e in prof.key_averages()
           if e.device_time_total > 0}
    sequence = _last_replay(prof, n_prof) if args.sequence else None
    kernel_ms = sum(ms for ms, _ in per.values())
    kinds: dict[str, float] = {}
    calls: dict[str, float] = {}
    for name, (ms, c) in per.items():
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + ms
        calls[_kind(name)] = calls.get(_kind(name), 0.0) + c
    del graphs, entry, kv, states, model
    torch.cuda.empty_cache()
    return {"model": path, "batch": b, "context": ctx,
            "loop_ms": round(loop_ms, 4), "engine_ms": round(engine_ms, 4), "graph_ms": round(graph_ms, 4),
            "kernel_ms": round(kernel_ms, 4), "gaps_ms": round(graph_ms - kernel_ms, 4),
            "kinds_ms": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda e: -e[1])},
            "kinds_calls": {k: round(v, 1) for k, v in calls.items()},
            "top": [{"kernel": k[:80], "ms": round(ms, 4), "calls": round(c, 1)}
                    for k, (ms, c) in sorted(per.items(), key=lambda e: -e[1][0])[:args.top]],
            **({"sequence": sequence} if sequence is not None else {})}


def _last_replay(prof, replays: int) -> list[dict]:
    """The kernels of the last profiled replay in launch order: each one's start after the
    previous one's end (``gap_us``) and its duration, from the profiler's trace."""
    import os
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(kernels) // replays
    last = kernels[-per:] if per else []
    out, end = [], None
    for e in last:
        out.append({"kernel": e["name"][:60], "us": round(e["dur"], 2),
                    "gap_us": None if end is None else round(e["ts"] - end, 2)})
        end = e["ts"] + e["dur"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a checkpoint (repeat for several)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-profile", default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--no-merge", action="store_true")
    ap.add_argument("--sequence", action="store_true", help="also list the last replay's kernels in order, with gaps")
    ap.add_argument("--tile", action="append", default=[],
                    help="FORMAT.KEY=VALUE: a decode tile's setting for this run (JSON value), e.g. fp8.waves=8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py times CUDA graphs: it needs a CUDA device")
    from hpc_kernels.quant_gemm import TILES

    for item in args.tile:
        key, value = item.split("=", 1)
        fmt, name = key.split(".", 1)
        TILES[fmt][name] = json.loads(value)
    rows = [profile_model(path, args) for path in args.model]
    doc = {"benchmark": "profile_decode", "device": torch.cuda.get_device_name(0), "tiles": args.tile, "runs": rows}
    if len(rows) > 1:
        base = rows[0]
        doc["speedup_over_first"] = {r["model"]: {k: round(base[k] / r[k], 3) for k in ("loop_ms", "engine_ms", "graph_ms")}
                                     for r in rows[1:]}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
