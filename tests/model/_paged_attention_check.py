"""Run under TRITON_INTERPRET=1 (CPU) by test_paged_attention.py, or on CUDA as is: the paged decode attention kernel against gather + SDPA
over the same pages, for every built-in KV profile, GQA, ragged lengths and splits. Prints the
worst relative error per profile and exits non-zero past the bound."""

import sys

import torch
import torch.nn.functional as F

from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.plugins import kv_profile
from hpc_kernels import paged_attention

torch.manual_seed(0)
DEV = "cuda" if torch.cuda.is_available() and "--cuda" in sys.argv else "cpu"
if DEV == "cuda":
    torch.set_default_device("cuda")
H, H_KV, D = 8, 2, 64
lens = [1, 63, 64, 65, 300]  # ragged; 300 tokens = 5 pages over the splits
W = 8
worst = {}
for name in ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"):
    for dtype in ((torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,)):  # the 3.9 interpreter's tl.dot on bf16 is wrong; bf16 runs on the GPU
        kv = PagedKVStorage(kv_profile(name), 1, H_KV, D, 64, device=DEV)
        B = len(lens)
        tables = torch.stack([torch.randperm(64)[:W] for _ in range(B)])
        for b, n in enumerate(lens):
            slots = (tables[b][torch.arange(n) // 64] * 64 + torch.arange(n) % 64)
            kv.write(0, slots, torch.randn(n, H_KV, D).to(dtype), torch.randn(n, H_KV, D).to(dtype))
        q = torch.randn(B, H, D).to(dtype)
        seqlens = torch.tensor(lens)
        planes = kv.planes[0]
        fk, fv = kv._formats["k"], kv._formats["v"]
        gs = [float(kv.global_scales[0, i]) for i in range(2)]
        out = paged_attention.paged_decode_attention(
            q, fk, [planes[i] for i in kv._side_idx["k"]], gs[0], fv, [planes[i] for i in kv._side_idx["v"]], gs[1],
            tables, seqlens, D ** -0.5)
        err = 0.0
        for b, n in enumerate(lens):
            k, v = kv.gather(0, tables[b], n, dtype)
            k = k.transpose(0, 1).repeat_interleave(H // H_KV, 0)
            v = v.transpose(0, 1).repeat_interleave(H // H_KV, 0)
            ref = F.scaled_dot_product_attention(q[b][:, None].float(), k.float(), v.float(), scale=D ** -0.5)[:, 0]
            err = max(err, ((out[b].float() - ref).norm() / ref.norm()).item())
        worst[f"{name}/{str(dtype)[6:]}"] = err
        # rows past the queries (a pass's padding to a row block): zero, the queries' rows the same
        padded = paged_attention.paged_decode_attention(
            q, fk, [planes[i] for i in kv._side_idx["k"]], gs[0], fv, [planes[i] for i in kv._side_idx["v"]], gs[1],
            tables, seqlens, D ** -0.5, rows=B + 3)
        if padded.shape != (B + 3, H, D) or not torch.equal(padded[:B], out) or not bool((padded[B:] == 0).all()):
            worst[f"{name}/{str(dtype)[6:]}/padded"] = float("inf")
bad = {k: v for k, v in worst.items() if v > (1e-5 if k.endswith("float32") else 1e-2)}
print(worst)
sys.exit(1 if bad else 0)
