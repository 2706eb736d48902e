"""KV profile kernels: quantise-and-write and dequantise throughput per built-in profile, as a
ratio to the device-to-device copy bandwidth measured in the same run (goal >= 0.5).

Shape: a 27B-like batch, 64k tokens x 4 KV heads x head_dim 256, K and V in bf16, written into
one layer of a PagedKVStorage through a slot mapping and gathered back from all its pages.
Slot mapping ``pages``: the pages in a random order, tokens in order inside each page (how a
prefill fills its pages); ``tokens``: every token at a random slot (the worst case, reported
beside it). Bytes counted = bytes read + bytes written (as for the copy).

``write_ratio_exact_div`` times the same write with ``kv_quant_triton.CONFIG["fast_div"] = False``
(a correctly rounded division per value, the kernels before the reciprocal quotient), so one run
shows what the fast quotient gains; both paths store the same bytes.
``write_ratio`` and ``gather_ratio`` are the median of ``--repeats`` timings of the write or
gather replayed from a CUDA graph (the kernels' throughput; the engine replays its decode steps
from graphs too); ``eager`` has the same timed as Python calls, where the launch overhead of a
64k-token call is about as long as its GPU work, so those figures measure the host as much as
the kernels.
``write_ratio_sw_fp8`` / ``gather_ratio_sw_fp8`` (fp8 and nvfp4) time E4M3 done by integer
arithmetic instead of the GPU's conversion (``CONFIG["hw_fp8"] = False``).

``--sweep`` times the launch shapes (values per program x warps) in ``SWEEP_SHAPES`` for the
write and the gather, and prints a compact table to stderr after the JSON.

    python benchmarks/kv_profiles.py [--tokens 65536] [--reference] [--sweep]

Prints one JSON document (stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def _bench(fn) -> float:
    """Milliseconds per call (triton.testing.do_bench, else CUDA events)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200))
    except ImportError:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call that compiles its kernels): the
    returned callable replays it, so a timing measures the GPU's work, not the Python and
    Triton launch overhead of the eager call (about as long as a 64k-token gather itself)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(nbytes: int = 2 << 30) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gb_per_s": 2 * nbytes / ms / 1e6}


def bench_profile(profile, tokens: int, heads: int, head_dim: int, copy_gbs: float,
                  pattern: str = "pages", repeats: int = 1, eager: bool = False) -> dict:
    """Write and gather timings of one layer, replayed from CUDA graphs (``eager``: called from
    Python, launch overhead included); with ``repeats`` > 1, the median of that many timings."""
    from hpc_cli.memory.kv_pool import PagedKVStorage

    pages = tokens // 64
    pool = PagedKVStorage(profile, 1, heads, head_dim, pages, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(tokens, heads, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    v = (0.1 * torch.randn(tokens, heads, head_dim, device="cuda", generator=g)).to(torch.bfloat16)
    if pattern == "tokens":
        slots = torch.randperm(tokens, device="cuda", generator=g)
    else:
        perm = torch.randperm(pages, device="cuda", generator=g)
        slots = (perm[:, None] * 64 + torch.arange(64, device="cuda")[None, :]).reshape(-1)
    page_ids = torch.arange(pages, device="cuda")
    in_bytes = 2 * k.numel() * k.element_size()
    stored = tokens * heads * pool.layout.bytes_per_token_head
    write = lambda: pool.write(0, slots, k, v)  # noqa: E731
    gather = lambda: pool.gather(0, page_ids, tokens, torch.bfloat16)  # noqa: E731
    if not eager:
        write, gather = graphed(write), graphed(gather)
    w_ms = statistics.median(_bench(write) for _ in range(repeats))
    r_ms = statistics.median(_bench(gather) for _ in range(repeats))
    w_gbs = (in_bytes + stored) / w_ms / 1e6
    r_gbs = (in_bytes + stored) / r_ms / 1e6
    return {
        "bytes_per_token_head": pool.layout.bytes_per_token_head,
        "write_ms": round(w_ms, 4), "write_gb_per_s": round(w_gbs, 1), "write_ratio": round(w_gbs / copy_gbs, 3),
        "gather_ms": round(r_ms, 4), "gather_gb_per_s": round(r_gbs, 1), "gather_ratio": round(r_gbs / copy_gbs, 3),
    }


def _with_config(profile, tokens: int, heads: int, head_dim: int, copy_gbs: float, **config) -> dict | None:
    """bench_profile with kv_quant_triton.CONFIG updated by ``config`` (None without Triton)."""
    try:
        from hpc_kernels import kv_quant_triton as kt
    except Exception:  # no Triton: the writes are the torch reference anyway
        return None
    old = dict(kt.CONFIG)
    kt.CONFIG.update(config)
    try:
        return bench_profile(profile, tokens, heads, head_dim, copy_gbs)
    finally:
        kt.CONFIG.clear()
        kt.CONFIG.update(old)


def exact_div_write(profile, tokens: int, heads: int, head_dim: int, copy_gbs: float) -> dict:
    """The write timed again with the exact-division kernels (CONFIG["fast_div"] = False)."""
    e = _with_config(profile, tokens, heads, head_dim, copy_gbs, fast_div=False)
    return {} if e is None else {"write_ms_exact_div": e["write_ms"], "write_ratio_exact_div": e["write_ratio"]}


def software_fp8(profile, tokens: int, heads: int, head_dim: int, copy_gbs: float) -> dict:
    """Write and gather timed again with E4M3 converted by integer arithmetic (CONFIG["hw_fp8"])."""
    e = _with_config(profile, tokens, heads, head_dim, copy_gbs, hw_fp8=False)
    return {} if e is None else {"write_ratio_sw_fp8": e["write_ratio"], "gather_ratio_sw_fp8": e["gather_ratio"]}


#: --sweep: launch shapes (values per program, warps).
SWEEP_SHAPES = ((2048, 4), (4096, 4), (8192, 4), (4096, 8), (8192, 8))


def sweep(profile, tokens: int, heads: int, head_dim: int, copy_gbs: float) -> dict:
    """"VALUESxWARPS" -> {"write", "gather"} ratios."""
    out = {}
    for vals, warps in SWEEP_SHAPES:
        e = _with_config(profile, tokens, heads, head_dim, copy_gbs, block_values=vals, num_warps=warps)
        if e is None:
            return {}
        out[f"{vals}x{warps}"] = {"write": e["write_ratio"], "gather": e["gather_ratio"]}
    return out


def sweep_table(profiles: dict) -> str:
    """The sweep's ratios, one line per profile: write / gather per shape."""
    shapes = [f"{v}x{w}" for v, w in SWEEP_SHAPES]
    lines = ["ratio write/gather", f"{'profile':<20}" + "".join(f"{s:>12}" for s in shapes)]
    for name, entry in profiles.items():
        sw = entry.get("sweep", {})
        cells = [f"{sw[s]['write']:.2f}/{sw[s]['gather']:.2f}" if s in sw else "-" for s in shapes]
        lines.append(f"{name:<20}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timings per main figure (the median is reported)")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference on the GPU")
    ap.add_argument("--sweep", action="store_true", help="also time other kernel launch shapes")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs CUDA"
    from hpc_plugins.kv_profiles import BUILTIN_PROFILES

    copy = copy_bandwidth()
    out = {
        "slot_mapping": "pages in random order, tokens in order inside a page",
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
        "shape": {"tokens": args.tokens, "kv_heads": args.heads, "head_dim": args.head_dim, "layers": 1},
        "d2d_copy": {k: round(v, 3) for k, v in copy.items()},
        "goal_ratio": 0.5, "profiles": {},
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    for cls in BUILTIN_PROFILES:
        prof = cls()
        entry = bench_profile(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"], repeats=args.repeats)
        entry.update(exact_div_write(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"]))
        if prof.name in ("fp8-e4m3fn-row256", "nvfp4-g16"):
            entry.update(software_fp8(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"]))
        if args.reference:
            os.environ["HPC_KV_KERNELS"] = "torch"
            try:
                ref = bench_profile(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"], eager=True)
            finally:
                del os.environ["HPC_KV_KERNELS"]
            entry["reference_write_ms"], entry["reference_gather_ms"] = ref["write_ms"], ref["gather_ms"]
        ea = bench_profile(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"], eager=True)
        entry["eager"] = {"write_ratio": ea["write_ratio"], "gather_ratio": ea["gather_ratio"]}
        worst = bench_profile(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"], "tokens")
        entry["random_token_slots"] = {"write_ratio": worst["write_ratio"], "gather_ratio": worst["gather_ratio"]}
        if args.sweep:
            entry["sweep"] = sweep(prof, args.tokens, args.heads, args.head_dim, copy["gb_per_s"])
        out["profiles"][prof.name] = entry
        torch.cuda.empty_cache()
    out["all_meet_goal"] = all(min(e["write_ratio"], e["gather_ratio"]) >= 0.5 for e in out["profiles"].values())
    print(json.dumps(out, indent=2), flush=True)
    if args.sweep:
        print(sweep_table(out["profiles"]), file=sys.stderr)


if __name__ == "__main__":
    main()
