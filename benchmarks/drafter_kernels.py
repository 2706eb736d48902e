"""The block drafters' fused kernels alone against the torch ops they replace, on the GPU.

Each case is one call captured in a CUDA graph and replayed under ``triton.testing.do_bench`` (what
a drafter's round pays for it inside the round's graph):

* ``attention``: a draft block's attention (``hpc_kernels.block_attention``) over DFlash2's rings
  (``--heads`` query heads over ``--kv-heads`` of ``--head-dim``, a ``--window`` ring a lane), for
  lanes at several positions, against torch's path (the ring's ``index_select``, the mask, the
  concatenations, ``scaled_dot_product_attention``), for each launch in ``--launches`` (rows a
  step x warps x programs a lane; ``default`` is the shipped choice);
* ``select``: DFlash2's candidate selector (``hpc_kernels.candidate_select``) against torch's
  top-k, products and pick, over a ``--vocab`` row, with torch's top-k alone beside it.

Each fused result is checked against torch's (the attention within bf16 rounding; the selector's
picks, which may differ at bf16 near-ties of the torch ops, reported as the share alike).

    python benchmarks/drafter_kernels.py
    python benchmarks/drafter_kernels.py --positions 300,2048 --lanes 1,8 --launches 64x4x1,64x4x8

Prints one JSON document (and writes it to --out); a table goes to stderr. CUDA only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hpc_cli.bench.document import emit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_profiles import graphed  # noqa: E402


def _graphed_us(fn) -> float:
    """Microseconds a replay of ``fn`` captured in a CUDA graph takes (:func:`kv_profiles.graphed`)."""
    from triton.testing import do_bench

    return do_bench(graphed(fn), warmup=50, rep=300) * 1e3


def attention_cases(args, launches: list[tuple[str, dict]]) -> list[dict]:
    from hpc_kernels import block_attention as ba

    dev, bf = "cuda", torch.bfloat16
    Hq, KV, D, W = args.heads, args.kv_heads, args.head_dim, args.window
    out = []
    for B in args.lanes:
        for pos in args.positions:
            rings = torch.randn(2 * B, 1, 2, W, KV, D, device=dev, dtype=bf)
            slots = torch.arange(B, device=dev) * 2
            kc, vc, table = rings[:, 0, 0], rings[:, 0, 1], slots[:, None]
            p = torch.full((B,), pos, device=dev)
            q = torch.randn(B, Hq, D, device=dev, dtype=bf)
            kb, vb = torch.randn(B, KV, D, device=dev, dtype=bf), torch.randn(B, KV, D, device=dev, dtype=bf)
            cols = torch.cat([torch.arange(W, device=dev), torch.full((1,), -1, device=dev)])

            def torch_path():
                ring = rings[:, 0].index_select(0, slots)
                mask = (cols[None] < p[:, None])[:, None, None, :]
                keys = torch.cat([ring[:, 0].transpose(1, 2), kb[:, :, None]], 2)
                vals = torch.cat([ring[:, 1].transpose(1, 2), vb[:, :, None]], 2)
                o = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=mask, enable_gqa=Hq > KV)
                return o[:, :, 0]

            ref = torch_path().float()
            row = {"lanes": B, "position": pos, "torch_us": round(_graphed_us(torch_path), 2)}
            for name, kw in launches:
                def fused(kw=kw):
                    return ba.block_attention(q, kb, vb, kc, vc, table, W, p, W, **kw)

                err = float((fused().float() - ref).abs().max())
                assert err < 5e-2, f"{name} at {pos}: {err}"
                row[f"{name}_us"] = round(_graphed_us(fused), 2)
            out.append(row)
    return out


def select_cases(args) -> list[dict]:
    from hpc_kernels import candidate_select as cs

    dev, bf = "cuda", torch.bfloat16
    V, H, R, C = args.vocab, args.hidden, args.rank, args.candidates
    out = []
    for N in args.lanes:
        g = torch.Generator(device=dev).manual_seed(0)
        logits = torch.randn(N, V, device=dev, dtype=bf, generator=g)
        hid = torch.randn(N, H, device=dev, dtype=bf, generator=g)
        wa = torch.randn(R, H, device=dev, dtype=bf, generator=g) * 0.1
        wb = torch.randn(R, H, device=dev, dtype=bf, generator=g) * 0.1
        emb = torch.randn(V, H, device=dev, dtype=bf, generator=g)

        def torch_path():
            top = logits.topk(C, dim=-1)
            dot = torch.matmul(F.linear(F.embedding(top.indices, emb), wb), F.linear(hid, wa)[..., None])[..., 0]
            score = torch.add(top.values.float(), dot.float(), alpha=1 / math.sqrt(R))
            return top.indices.gather(-1, score.argmax(-1, keepdim=True))[:, 0]

        def fused():
            return cs.select(logits, hid, wa, wb, emb, C, 1 / math.sqrt(R))

        out.append({"rows": N, "torch_us": round(_graphed_us(torch_path), 2), "fused_us": round(_graphed_us(fused), 2),
                    "topk_alone_us": round(_graphed_us(lambda: logits.topk(C, dim=-1)), 2),
                    "same_picks": float((fused() == torch_path()).float().mean())})
    return out


def _launch(spec: str) -> tuple[str, dict]:
    if spec == "default":
        return "default", {}
    n, w, s = (int(x) for x in spec.split("x"))
    return spec, {"block_n": n, "num_warps": w, "splits": s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--lanes", type=ints, default=[1, 8])
    ap.add_argument("--positions", type=ints, default=[300, 2048])
    ap.add_argument("--launches", default="64x4x1,128x4x1,64x4x4,default",
                    help="the attention's launches, ROWSxWARPSxPROGRAMS or default, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("times GPU kernels: needs CUDA")
    launches = [_launch(x) for x in args.launches.split(",") if x]
    doc = {"benchmark": "drafter_kernels", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "attention": attention_cases(args, launches), "select": select_cases(args)}
    emit(doc, args.out)
    names = [n for n, _ in launches]
    print("attention: lanes, position | torch | " + " | ".join(names) + "  (us)", file=sys.stderr)
    for r in doc["attention"]:
        print(f"  {r['lanes']:3} {r['position']:6} | {r['torch_us']:7.1f} | "
              + " | ".join(f"{r[n + '_us']:7.1f}" for n in names), file=sys.stderr)
    print("select: rows | torch | fused | top-k alone  (us) | same picks", file=sys.stderr)
    for r in doc["select"]:
        print(f"  {r['rows']:3} | {r['torch_us']:7.1f} | {r['fused_us']:7.1f} | {r['topk_alone_us']:7.1f} | "
              f"{r['same_picks']:.2f}", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
