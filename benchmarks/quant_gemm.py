"""The quantized-weight matmul kernels (``kernels/quant_gemm.py``) at the 27B model's Linear
shapes, against bf16 ``F.linear`` on the same device, timed with ``triton.testing.do_bench``:
for decode-sized passes (1, 8 rows) each tile of a sweep of the rows kernels, for prefill-sized
ones the dequantise-then-cuBLAS path and (FP8) cuBLAS's block-scaled product. A component
benchmark: it explains the model's figures (``benchmarks/model_throughput.py``), it does not
prove them. Prints JSON, then a table of the best tile per (rows, format) as time against bf16
summed over the shapes of one layer set.

    python benchmarks/quant_gemm.py [--rows 1,8,512,2048] [--sweep] [--out F]

Each time is a CUDA graph's replay divided by the calls captured in it, as the engine replays its
passes: a Triton launch costs tens of microseconds of host time, more than a decode-sized product
takes on the device, so timing eager calls would time the host.
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
          ("mlp.gate", 17408, 5120), ("mlp.up", 17408, 5120), ("mlp.down", 5120, 17408)]
DECODE_TILES = [{"BN": bn, "BK": bk, "num_warps": w, "num_stages": s, "waves": v}
                for bn, bk, w, s, v in itertools.product((16, 32, 64), (256, 512), (4,), (3, 4), (4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,512,2048")
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="time every decode tile (default: the shipped one)")
    args = ap.parse_args()
    from triton.testing import do_bench as bench

    def do_bench(fn, calls: int = 20) -> float:
        """Milliseconds per call of ``fn`` replayed in a CUDA graph (``calls`` calls a replay), as
        the engine runs decode and prefill passes: the host's launch cost is not in it (a weight
        smaller than the L2 cache, 50 MB on an H200, stays there between the calls)."""
        fn()  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return bench(graph.replay, warmup=10, rep=60) / calls

    from hpc_cli.model.quant_weights import quantize_fp8, quantize_nvfp4
    from hpc_kernels import quant_gemm

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float32) * 0.02
        packed, scale, glob = quantize_nvfp4(w)
        weights[name] = (w.bfloat16(), quantize_fp8(w, (128, 128)), (packed, scale, 1.0 / float(glob), 16))
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        kind = "decode" if m <= quant_gemm.DECODE_ROWS else "prefill"
        for name, n, k in SHAPES:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            bf, fp8, nv = weights[name]
            ms = {"fp8": {}, "nvfp4": {}}  # format -> variant -> ms
            if kind == "decode":
                for tile in DECODE_TILES if args.sweep else [dict(quant_gemm.TILES["decode"])]:
                    quant_gemm.TILES["decode"] = tile
                    key = "BN{BN}_BK{BK}_w{num_warps}_s{num_stages}_v{waves}".format(**tile)
                    ms["fp8"][key] = do_bench(lambda: quant_gemm.fp8_linear(x, fp8[0], fp8[1], (128, 128)))
                    ms["nvfp4"][key] = do_bench(lambda: quant_gemm.nvfp4_linear(x, *nv))
            else:
                ms["fp8"]["dequantized"] = do_bench(lambda: quant_gemm.fp8_linear(x, fp8[0], fp8[1], (128, 128)))
                ms["nvfp4"]["dequantized"] = do_bench(lambda: quant_gemm.nvfp4_linear(x, *nv))
                if quant_gemm.scaled_mm_ready(dev):  # the FP8 tensor cores (cuBLAS)
                    mm = quant_gemm.scales_for_mm(fp8[1])
                    ms["fp8"]["scaled_mm"] = do_bench(lambda: quant_gemm.fp8_linear(x, fp8[0], fp8[1], (128, 128), mm))
            row = {"rows": m, "shape": name, "N": n, "K": k, "bf16_ms": do_bench(lambda: F.linear(x, bf)), "ms": ms}
            best = {fmt: min(v, key=v.get) for fmt, v in ms.items()}
            if m == 1:  # the weight bytes each reads, over its time: the bandwidth it reaches
                row["TBps"] = {"bf16": 2 * n * k / row["bf16_ms"] / 1e9,
                               "fp8": n * k / ms["fp8"][best["fp8"]] / 1e9,
                               "nvfp4": n * k / 2 / ms["nvfp4"][best["nvfp4"]] / 1e9}
            results.append(row)
            print(f"rows {m} {name}: bf16 {row['bf16_ms']:.4f} ms; " + "; ".join(
                f"{fmt} {b} {ms[fmt][b]:.4f} ms ({row['bf16_ms'] / ms[fmt][b]:.2f}x)" for fmt, b in best.items())
                + (" | TB/s " + " ".join(f"{f} {v:.2f}" for f, v in row["TBps"].items()) if "TBps" in row else ""),
                flush=True)
    doc = {"device": torch.cuda.get_device_name(), "results": results}
    decode = [r for r in results if r["rows"] <= quant_gemm.DECODE_ROWS]
    if decode:  # the decode tile that is fastest over all decode-sized rows and shapes, both formats
        keys = list(decode[0]["ms"]["fp8"])
        best = min(keys, key=lambda t: sum(r["ms"][f][t] for r in decode for f in ("fp8", "nvfp4")))
        doc["best_decode_tile"] = next(t for t in DECODE_TILES + [quant_gemm.TILES["decode"]]
                                       if "BN{BN}_BK{BK}_w{num_warps}_s{num_stages}_v{waves}".format(**t) == best)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    for m in sorted({r["rows"] for r in results}):
        rows = [r for r in results if r["rows"] == m]
        bf = sum(r["bf16_ms"] for r in rows)
        for fmt in ("fp8", "nvfp4"):
            best = min(rows[0]["ms"][fmt], key=lambda v: sum(r["ms"][fmt][v] for r in rows))
            total = sum(r["ms"][fmt][best] for r in rows)
            per_shape = "  ".join(f"{r['shape']} {r['bf16_ms'] / r['ms'][fmt][best]:.2f}" for r in rows)
            print(f"rows {m:5d} {fmt:5s} best {best:26s} {total:8.3f} ms vs bf16 {bf:8.3f} ms "
                  f"= {bf / total:.2f}x   [{per_shape}]")


if __name__ == "__main__":
    main()
