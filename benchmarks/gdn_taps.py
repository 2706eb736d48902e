"""What an exact tap costs (spec §7.2-7.3), at a model's widths on CUDA, one run:

* ``plain``: a cold prompt of ``--tokens`` in passes of ``--chunk``, no tap;
* ``in_pass``: the same passes taking ``--taps`` exact taps inside them (the zero-split tap:
  a prefill graph with tap slots), each tap's image copied into a snapshot slot after its pass;
* ``split``: the same taps taken as before, by ending a pass at each tap and copying the lane's
  state slot into a snapshot slot (``StateSlots.copy_slot``);
* ``copy``: that snapshot copy alone.

Prints JSON with the median seconds of each and ``tap_cost_over_copy`` (``(in_pass - plain) /
taps`` over one copy: the goal is <= 1.1) and ``in_pass_throughput`` (``plain / in_pass``, the
goal >= 0.97 with 8 taps in 8k tokens).

    python benchmarks/gdn_taps.py --model builtin:qwen3.5-27b-shape@8 --kv-profile int8-g64
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _timed(fn, repeat: int) -> float:
    fn()
    fn()  # the first two runs of a shape compile and capture its graphs
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:qwen3.5-27b-shape@8")
    ap.add_argument("--kv-profile", default="int8-g64")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--taps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path(args.model, dtype=torch.bfloat16, device="cuda")
    n, chunk = args.tokens, args.chunk
    kv = model.new_kv_storage(args.kv_profile, -(-n // 64) + 1)
    states = model.new_state_slots(2 + args.taps)
    tokens = torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(-(-n // 64)))
    passes = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    per = -(-args.taps // len(passes))
    taps = []  # off the 64-token grid, spread over the passes
    for a, b in passes:
        taps += [a + (b - a) * (j + 1) // (per + 1) + 13 for j in range(per)]
    taps = sorted(taps)[:args.taps]

    def plain():
        states.reset(0)
        for a, b in passes:
            model.prefill(tokens[a:b], a, table, 0, kv, states)

    def in_pass():
        states.reset(0)
        slot = 2
        for a, b in passes:
            out = model.prefill(tokens[a:b], a, table, 0, kv, states, taps=[p for p in taps if a < p < b])
            for image in out.taps:
                states.write_image(slot, image)
                slot += 1

    def split():
        states.reset(0)
        slot = 2
        for a, b in passes:
            cuts = [a, *[p for p in taps if a < p < b], b]
            for x, y in zip(cuts, cuts[1:]):
                model.prefill(tokens[x:y], x, table, 0, kv, states)
                if y != b:
                    states.copy_slot(0, slot)
                    slot += 1

    def copy():
        for j in range(args.taps):
            states.copy_slot(0, 2 + j)

    out = {"model": args.model, "kv_profile": args.kv_profile, "tokens": n, "chunk": chunk, "taps": taps,
           "device": torch.cuda.get_device_name()}
    out["plain_s"] = _timed(plain, args.repeat)
    out["in_pass_s"] = _timed(in_pass, args.repeat)
    out["split_s"] = _timed(split, args.repeat)
    out["copy_s"] = _timed(copy, args.repeat) / args.taps
    graphs = model.prefill_graphs(kv)
    out["graph_replays"] = graphs.replays if graphs is not None else 0
    out["tap_slots"] = graphs.tap_slots if graphs is not None else 0
    out["tap_s"] = (out["in_pass_s"] - out["plain_s"]) / len(taps)
    out["split_tap_s"] = (out["split_s"] - out["plain_s"]) / len(taps)
    out["tap_cost_over_copy"] = out["tap_s"] / out["copy_s"]
    out["in_pass_throughput"] = out["plain_s"] / out["in_pass_s"]
    out["split_throughput"] = out["plain_s"] / out["split_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
