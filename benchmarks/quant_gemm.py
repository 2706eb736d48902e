"""The quantized-weight matmul kernels (``hpc_kernels/quant_gemm.py``) at the 27B model's Linear
shapes, against bf16 ``F.linear`` on the same device: for decode-sized passes each decode tile
of a sweep (tensor-core and register variants), for prefill-sized ones the
dequantise-then-cuBLAS path and (FP8) cuBLAS's block-scaled product. A component benchmark: it
explains the model's figures (``benchmarks/model_throughput.py``), it does not prove them.
Prints a line per (rows, shape), a table of the best tile per (rows, format) as time against
bf16 summed over the shapes of one layer set, and JSON (``--out``) with the best decode tile of
each format.

    python benchmarks/quant_gemm.py [--rows 16,2048] [--sweep] [--shapes attn.q,mlp.up] [--out F]

Each time is a CUDA graph's replay divided by the calls captured in it, as the engine replays its
passes (a Triton launch costs more host time than a decode-sized product takes on the device).
The calls rotate over copies of the weight that together exceed the L2 cache several times, as
a model's layers do, so no weight is read from L2.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

#: (name, N, K) of the Linears of one full-attention and one GDN layer with their MLPs, at the
#: 27B widths (hidden 5120, intermediate 17408, 24 query heads of 256 gated, 4 KV heads, GDN 16
#: key and 48 value heads of 128)
SHAPES = [("attn.q", 12288, 5120), ("attn.kv", 1024, 5120), ("attn.o", 5120, 6144),
          ("gdn.qkv", 10240, 5120), ("gdn.z", 6144, 5120), ("gdn.out", 5120, 6144),
          ("mlp.gate", 17408, 5120), ("mlp.up", 17408, 5120), ("mlp.down", 5120, 17408),
          # the merged products the model runs (hpc_cli/model/merged.py): q/k/v, the GDN's qkv + z, gate + up
          ("attn.qkv", 14336, 5120), ("gdn.qkvz", 16384, 5120), ("mlp.gate_up", 34816, 5120)]
#: the products of a merged model's attention and GDN layer with their MLPs (the default)
MERGED = ("attn.qkv", "attn.o", "gdn.qkvz", "gdn.out", "mlp.gate_up", "mlp.down")
#: the decode tiles a sweep times: sums in registers, and the two tensor-core forms
DECODE_TILES = (
    [{"BN": bn, "BK": 128, "num_warps": 4, "num_stages": 3, "waves": 8} for bn in (16, 32)]
    + [{"BN": bn, "BK": 128, "num_warps": w, "num_stages": s, "waves": v, "dot": True}
       for bn, w, s, v in itertools.product((16, 32), (4,), (4, 6), (8, 16))]
    + [{"BN": 32, "BK": 128, "num_warps": 2, "num_stages": 4, "waves": 8, "dot": True},
       {"BN": 64, "BK": 128, "num_warps": 8, "num_stages": 4, "waves": 8, "dot": True},
       {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "waves": 4, "dot": True, "swap": True}]
    # FP8 only (NVFP4 ignores the flag): the FP8 matrix units, rows quantized to e4m3 per 128 inputs
    + [{"BN": bn, "BK": 128, "num_warps": w, "num_stages": s, "waves": v, "e4m3": True}
       for bn, w, s, v in ((64, 4, 3, 4), (128, 4, 3, 2), (128, 8, 3, 2), (64, 4, 4, 2), (128, 4, 2, 4))])
#: ``--sweep e4m3``: the FP8 matrix units' tile alone, over its widths, stages and waves
E4M3_TILES = [{"BN": bn, "BK": 128, "num_warps": 4, "num_stages": s, "waves": v, "e4m3": True}
              for bn, s, v in itertools.product((32, 64, 128), (3, 4), (2, 4, 8))]
#: FP8 only: decode-sized rows quantized to e4m3 for cuBLAS's block-scaled product
SCALED_MM_TILE = {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 4, "waves": 8, "dot": True, "scaled_mm": True}
L2_MULTIPLE = 400e6  # bytes of weight copies a timing rotates over


def tile_key(t: dict) -> str:
    if t.get("scaled_mm"):
        return "scaled_mm"
    kind = "e4m3" if t.get("e4m3") else "swap" if t.get("swap") else "dot" if t.get("dot") else "reg"
    return f"{kind}_BN{t['BN']}_BK{t['BK']}_w{t['num_warps']}_s{t['num_stages']}_v{t['waves']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,2048", help="rows a pass (the engine runs decode in blocks of 16)")
    ap.add_argument("--shapes", default=",".join(MERGED),
                    help="comma-separated names of SHAPES (default: a merged model's products)")
    ap.add_argument("--out")
    ap.add_argument("--sweep", nargs="?", const="all", choices=("all", "e4m3"),
                    help="time every decode tile (default: the shipped ones); e4m3: FP8's matrix-unit tiles only")
    ap.add_argument("--formats", default="fp8,nvfp4", help="comma list of the weight formats to time")
    args = ap.parse_args()
    formats = [f for f in ("fp8", "nvfp4") if f in args.formats.split(",")]
    from triton.testing import do_bench as bench

    def do_bench(fns) -> float:
        """Milliseconds per call of the ``fns`` (one per weight copy) replayed in a CUDA graph."""
        for fn in fns:
            fn()  # compile
        torch.cuda.synchronize()
        calls = [fns[i % len(fns)] for i in range(max(8, len(fns)))]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        return bench(graph.replay, warmup=5, rep=30) / len(calls)

    from hpc_cli.model.quant_weights import quantize_fp8, quantize_nvfp4
    from hpc_kernels import quant_gemm

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shipped = {f: dict(quant_gemm.TILES[f]) for f in ("fp8", "nvfp4")}
    results = []
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float32) * 0.02
        copies = max(1, min(32, int(L2_MULTIPLE // (n * k) + 1)))
        bf = [w.bfloat16() for _ in range(copies)]
        fp8, nv = [], []  # the formats timed only
        if "fp8" in formats:
            fq, fs = quantize_fp8(w, (128, 128))
            fp8 = [(fq.clone(), fs.clone()) for _ in range(copies)]
        if "nvfp4" in formats:
            packed, scale, glob = quantize_nvfp4(w)
            nv = [(packed.clone(), scale.clone(), 1.0 / float(glob), 16) for _ in range(copies)]
        mm = [quant_gemm.scales_for_mm(s) for _, s in fp8]
        del w
        for m in (int(r) for r in args.rows.split(",")):
            decode = m <= quant_gemm.DECODE_ROWS
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            ms: dict[str, dict[str, float]] = {f: {} for f in formats}  # format -> variant -> ms
            if decode:
                for fmt in formats:
                    if args.sweep == "e4m3":
                        tiles = E4M3_TILES if fmt == "fp8" else [shipped[fmt]]
                    elif args.sweep:
                        tiles = ([t for t in DECODE_TILES if fmt == "fp8" or not t.get("e4m3")]
                                 + [SCALED_MM_TILE] * (fmt == "fp8"))
                    else:
                        tiles = [shipped[fmt]]
                    for tile in tiles:
                        quant_gemm.TILES[fmt] = tile
                        if fmt == "fp8":
                            fns = [lambda q=q, s=s, a=a: quant_gemm.fp8_linear(x, q, s, (128, 128), a)
                                   for (q, s), a in zip(fp8, mm)]
                        else:
                            fns = [lambda c=c: quant_gemm.nvfp4_linear(x, *c) for c in nv]
                        try:
                            ms[fmt][tile_key(tile)] = do_bench(fns)
                        except Exception as exc:  # a tile that does not build here (shared memory)
                            print(f"{fmt} {tile_key(tile)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                            ms[fmt][tile_key(tile)] = float("inf")
                    quant_gemm.TILES[fmt] = shipped[fmt]
            else:
                if "fp8" in formats:
                    ms["fp8"]["dequantized"] = do_bench(
                        [lambda q=q, s=s: quant_gemm.fp8_linear(x, q, s, (128, 128)) for q, s in fp8])
                if "nvfp4" in formats:
                    ms["nvfp4"]["dequantized"] = do_bench([lambda c=c: quant_gemm.nvfp4_linear(x, *c) for c in nv])
                if "fp8" in formats and quant_gemm.scaled_mm_ready(dev):  # the FP8 tensor cores (cuBLAS)
                    ms["fp8"]["scaled_mm"] = do_bench(
                        [lambda q=q, s=s, a=a: quant_gemm.fp8_linear(x, q, s, (128, 128), a)
                         for (q, s), a in zip(fp8, mm)])
            row = {"rows": m, "shape": name, "N": n, "K": k,
                   "bf16_ms": do_bench([lambda b=b: F.linear(x, b) for b in bf]), "ms": ms}
            best = {fmt: min(v, key=v.get) for fmt, v in ms.items()}
            if decode:  # the weight bytes each reads, over its time: the bandwidth it reaches
                per_byte = {"fp8": 1.0, "nvfp4": 0.5}
                row["TBps"] = {"bf16": 2 * n * k / row["bf16_ms"] / 1e9}
                row["TBps"].update({f: per_byte[f] * n * k / ms[f][best[f]] / 1e9 for f in formats})
            results.append(row)
            print(f"rows {m} {name}: bf16 {row['bf16_ms']:.4f} ms; " + "; ".join(
                f"{fmt} {b} {ms[fmt][b]:.4f} ms ({row['bf16_ms'] / ms[fmt][b]:.2f}x)" for fmt, b in best.items())
                + (" | TB/s " + " ".join(f"{f} {v:.2f}" for f, v in row["TBps"].items()) if "TBps" in row else ""),
                flush=True)
        del bf, fp8, nv, mm
        torch.cuda.empty_cache()
    doc: dict = {"device": torch.cuda.get_device_name(), "results": results, "best_decode_tiles": {}}
    decode_rows = [r for r in results if r["rows"] <= quant_gemm.DECODE_ROWS]
    for fmt in formats:  # the tile fastest over all decode-sized rows and shapes
        if decode_rows:
            keys = list(decode_rows[0]["ms"][fmt])
            best = min(keys, key=lambda t: sum(r["ms"][fmt][t] for r in decode_rows))
            doc["best_decode_tiles"][fmt] = next(t for t in DECODE_TILES + E4M3_TILES + [SCALED_MM_TILE, shipped[fmt]]
                                                 if tile_key(t) == best)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    for m in sorted({r["rows"] for r in results}):
        rows = [r for r in results if r["rows"] == m]
        bf = sum(r["bf16_ms"] for r in rows)
        for fmt in formats:
            best = min(rows[0]["ms"][fmt], key=lambda v: sum(r["ms"][fmt][v] for r in rows))
            total = sum(r["ms"][fmt][best] for r in rows)
            per_shape = "  ".join(f"{r['shape']} {r['bf16_ms'] / r['ms'][fmt][best]:.2f}" for r in rows)
            print(f"rows {m:5d} {fmt:5s} best {best:28s} {total:8.3f} ms vs bf16 {bf:8.3f} ms "
                  f"= {bf / total:.2f}x   [{per_shape}]")
    print("best decode tiles", json.dumps(doc["best_decode_tiles"]))


if __name__ == "__main__":
    main()
