"""The paged prefill attention kernel (``hpc_kernels/paged_prefill.py``) at the 27B model's
attention widths (24 query heads, 4 KV heads of 256), for the passes a server runs: a cached
turn's (a few hundred new tokens after thousands cached) and a cold prompt's chunks. Times each
launch configuration of a sweep (rows per program, warps, stages) with CUDA events over a CUDA
graph of several launches, reports the device time and the attention's rate (TFLOP/s of its two
products, causal), and checks that every configuration gives the shipped one's output bit for bit
(a row's result does not depend on which rows share its program). A component benchmark: it
explains the pass's time (``benchmarks/profile_pass.py``), it does not prove a serving figure.

    python benchmarks/prefill_attention.py [--profiles int8-g64,bf16] [--passes 512@4096,2048@0] [--configs m128_w8_s3] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

H, H_KV, D = 24, 4, 256
CONFIGS = [{"block_m": m, "num_warps": w, "num_stages": s}
           for m, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
#: half-page key tiles (other sums, so other bits than a page's: compared, not required equal)
CONFIGS += [dict(c, block_n=32) for c in CONFIGS if c["block_m"] >= 64]


def config_key(cfg: dict[str, int]) -> str:
    return f"m{cfg['block_m']}_w{cfg['num_warps']}_s{cfg['num_stages']}" + (f"_n{cfg['block_n']}" if "block_n" in cfg else "")


def flops(start: int, t: int) -> float:
    """The two products' floating-point operations of ``t`` queries from ``start``, causal."""
    keys = t * start + t * (t + 1) / 2  # keys read over the rows of one head
    return 4.0 * D * H * keys


def timed(fn, launches: int = 10, rounds: int = 30) -> float:
    """Median seconds a launch, ``launches`` of them replayed from one CUDA graph (captured as
    the engine captures its passes, after a warm call that compiles)."""
    from hpc_cli.model.graphs import capture_graph

    fn()
    graph, _ = capture_graph(None, lambda: [fn() for _ in range(launches)])
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / launches)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="int8-g64", help="comma list of KV profiles")
    ap.add_argument("--passes", default="512@4096,256@2048,2048@0,2048@2048",
                    help="comma list of NEW@CACHED token counts")
    ap.add_argument("--configs", default=None, help="comma list of configurations to time besides the "
                    "shipped one (as printed: m128_w8_s3); default all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.plugins import kv_profile
    from hpc_kernels import paged_prefill

    torch.manual_seed(0)
    dev = torch.device("cuda")
    wanted = None if args.configs is None else set(args.configs.split(","))
    results = []
    for profile in args.profiles.split(","):
        for spec in args.passes.split(","):
            t, start = (int(x) for x in spec.split("@"))
            shipped = dict(paged_prefill.launch_config(D, t))
            sweep = [shipped] + [c for c in CONFIGS if c != shipped and (wanted is None or config_key(c) in wanted)]
            end = start + t
            pages = (end + 63) // 64
            kv = PagedKVStorage(kv_profile(profile), 1, H_KV, D, pages + 4, device=dev)
            table = torch.randperm(pages + 4, device=dev)[:pages]
            pos = torch.arange(end, device=dev)
            kv.write(0, table[pos // 64] * 64 + pos % 64,
                     torch.randn(end, H_KV, D, device=dev, dtype=torch.bfloat16),
                     torch.randn(end, H_KV, D, device=dev, dtype=torch.bfloat16))
            q = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16)

            def run() -> torch.Tensor:
                return kv.prefill_attention(0, q, table, start, D ** -0.5)

            ref = None
            row = {"profile": profile, "tokens": t, "start": start, "gflop": round(flops(start, t) / 1e9, 2),
                   "shipped": config_key(shipped), "configs": {}}
            for cfg in sweep:
                key = config_key(cfg)
                with paged_prefill.every_pass_with(cfg):
                    try:
                        out = run()
                        torch.cuda.synchronize()
                    except Exception as exc:  # a configuration past the device's resources
                        row["configs"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                        continue
                    sec = timed(run)
                same = ref is None or bool(torch.equal(out, ref))
                if ref is None:
                    ref = out.clone()
                row["configs"][key] = {"us": round(sec * 1e6, 1), "tflops": round(flops(start, t) / sec / 1e12, 1),
                                       "equal_to_shipped": same}
                print(f"{profile:18s} {t:5d} new after {start:5d}: {key:14s} {sec * 1e6:8.1f} us "
                      f"{flops(start, t) / sec / 1e12:6.1f} TFLOP/s{'' if same else '  (differs from the shipped config)'}",
                      flush=True)
            results.append(row)

    print("\nbest per pass (shipped first):")
    for row in results:
        ok = {k: v for k, v in row["configs"].items() if "us" in v}
        first = next(iter(ok))
        best = min(ok, key=lambda k: ok[k]["us"])
        print(f"  {row['profile']} {row['tokens']}@{row['start']}: shipped {first} {ok[first]['us']} us; best {best} {ok[best]['us']} us "
              f"({ok[first]['us'] / ok[best]['us']:.2f}x), equal {ok[best]['equal_to_shipped']}")
    doc = {"benchmark": "prefill_attention", "device": torch.cuda.get_device_name(), "profiles": args.profiles,
           "passes": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
