"""Where a cached turn's prefill pass spends its device time: one pass of ``--tokens`` new tokens
after ``--context`` cached ones, replayed from its CUDA graph (with ``--taps`` taps inside it and
without), timed with CUDA events and profiled eagerly with the torch profiler (the top kernels by
device time). A component benchmark: it explains serving figures, it does not prove them.

    python benchmarks/profile_pass.py --model builtin:qwen3.5-27b-shape@8 --tokens 512 --context 4096
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:qwen3.5-27b-shape@8")
    ap.add_argument("--kv-profile", default="int8-g64")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--taps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()

    from hpc_cli.model.model import HybridModel, TapImage

    model = HybridModel.from_name_or_path(args.model, dtype=torch.bfloat16, device="cuda")
    start, n = args.context, args.tokens
    pages = -(-(start + n) // 64)
    kv, states = model.new_kv_storage(args.kv_profile, pages + 1), model.new_state_slots(1 + args.taps)
    tokens = torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(pages))
    taps = [start + n * (j + 1) // (args.taps + 1) + 7 for j in range(args.taps)]

    def run(tapped: bool):
        states.reset(0)
        model.prefill(tokens, start, table, 0, kv, states,
                      taps=[TapImage(p, 1 + j) for j, p in enumerate(taps)] if tapped else ())

    out = {"model": args.model, "tokens": n, "context": start, "taps": taps}
    for tapped in (False, True):
        for _ in range(2):
            run(tapped)  # the eager pass, then the capture
        times = []
        for _ in range(args.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(tapped)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        out["graph_ms_tapped" if tapped else "graph_ms"] = statistics.median(times)
    model.cuda_graphs = False
    run(True)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(True)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    out["eager_device_ms"] = total / 1000
    out["top"] = [{"kernel": e.key[:90], "ms": round(e.device_time_total / 1000, 3), "calls": e.count,
                   "share": round(e.device_time_total / total, 3)}
                  for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
