"""Where a cached turn's prefill pass spends its device time: one pass of ``--tokens`` new tokens
after ``--context`` cached ones, replayed from its CUDA graph (with ``--taps`` taps inside it and
without, the two taking turns), timed with CUDA events; and the graph's kernels launched eagerly
(``prefill_core``) under the torch profiler: the top kernels by device time of the tapped pass,
and what the taps add kernel by kernel (``taps_add``; ``replay_taps_add`` the same for the
replays, where the profiler sees a graph's kernels). A component benchmark: it explains serving
figures, it does not prove them.

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
    ap.add_argument("--vocab", type=int, default=None,
                    help="a seeded builtin shape with this vocabulary (the 248k-row lm_head's time blurs a tap's)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--taps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()

    from hpc_cli.model.model import HybridModel, TapImage

    if args.vocab:
        from hpc_cli.model.builtin import build_builtin

        model = build_builtin(args.model, dtype=torch.bfloat16, device="cuda", vocab_size=args.vocab)
    else:
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
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(2 * args.repeat):  # paired: the two take turns, so clock drift falls on both
        for tapped in ((False, True) if r % 2 == 0 else (True, False)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(tapped)
            b.record()
            b.synchronize()
            times[tapped].append(a.elapsed_time(b))
    out["graph_ms"] = statistics.median(times[False])
    out["graph_ms_tapped"] = statistics.median(times[True])
    out["graph_ms_taps_add"] = statistics.median(y - x for x, y in zip(times[False], times[True]))

    from torch.profiler import ProfilerActivity, profile

    from hpc_cli.model.prefill_core import PrefillIndex, prefill_core

    graphs = model.prefill_graphs(kv)
    slots = graphs.tap_slots if graphs is not None else 0

    def kernels(fn) -> dict[str, tuple[float, int]]:
        """Device ms and calls per kernel of one call of ``fn``."""
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return {e.key: (e.device_time_total / 1000, e.count) for e in prof.key_averages() if e.device_time_total > 0}

    def core(tapped: bool):
        """The graph's own kernels, launched eagerly: ``prefill_core`` with tap slots or without."""
        states.reset(0)
        at = [(p - start, 1 + j) for j, p in enumerate(taps)] if tapped else []
        idx = PrefillIndex.build(model, tokens, start, table, 0, -(-n // 64) * 64, kv.page_tokens, taps=at,
                                 slots=slots if tapped else 0)
        prefill_core(model, idx, kv, states)

    def added(plain: dict, tapped: dict) -> list[dict]:
        diff = {k: (tapped.get(k, (0.0, 0))[0] - plain.get(k, (0.0, 0))[0],
                    tapped.get(k, (0.0, 0))[1] - plain.get(k, (0.0, 0))[1]) for k in {*plain, *tapped}}
        return [{"kernel": k[:90], "ms": round(ms, 4), "calls": c}
                for k, (ms, c) in sorted(diff.items(), key=lambda e: -abs(e[1][0]))[:args.top]]

    plain, tapped = kernels(lambda: core(False)), kernels(lambda: core(True))
    total = sum(ms for ms, _ in tapped.values())
    out["core_device_ms"] = sum(ms for ms, _ in plain.values())
    out["core_device_ms_tapped"] = total
    out["top"] = [{"kernel": k[:90], "ms": round(ms, 3), "calls": c, "share": round(ms / total, 3)}
                  for k, (ms, c) in sorted(tapped.items(), key=lambda e: -e[1][0])[:args.top]]
    out["taps_add"] = added(plain, tapped)  # what the taps add, kernel by kernel
    # the replays themselves, where the profiler sees a graph's kernels
    out["replay_taps_add"] = added(kernels(lambda: run(False)), kernels(lambda: run(True)))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
