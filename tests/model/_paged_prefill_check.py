"""Run under TRITON_INTERPRET=1 (CPU) by test_paged_attention.py, or on CUDA as is: the paged prefill
attention kernel against gather + causal SDPA over the same pages (fp32 reference), for every
built-in KV profile, GQA with a head group that is not a power of two, passes that start at 0, in a
page and on a page boundary, and padded rows; then, at heads of 256, that the kernel's two launch
configurations give the same bits and key tiles of half a page the same attention. Prints the
worst relative error per profile and exits non-zero past the bound or where the configurations
differ (key tiles of half a page: beyond the bound)."""

import sys

import torch
import torch.nn.functional as F

from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.plugins import kv_profile
from hpc_kernels import paged_prefill

torch.manual_seed(0)
DEV = "cuda" if torch.cuda.is_available() and "--cuda" in sys.argv else "cpu"
if DEV == "cuda":
    torch.set_default_device("cuda")
H, H_KV, D = 12, 2, 64  # 6 query heads per KV head
PAGES = 16
# (start, valid tokens, padded rows)
passes = [(0, 1, 0), (0, 70, 0), (64, 64, 0), (100, 37, 27), (5, 130, 62)] if DEV == "cpu" else \
    [(0, 1, 63), (0, 70, 0), (64, 64, 0), (100, 37, 27), (5, 300, 20), (640, 320, 0)]
worst = {}
for name in ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"):
    for dtype in ((torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,)):
        err = 0.0
        for start, n, pad in passes:
            kv = PagedKVStorage(kv_profile(name), 1, H_KV, D, PAGES, device=DEV)
            end = start + n
            table = torch.randperm(PAGES)[:(end + 63) // 64]
            pos = torch.arange(end)
            slots = table[pos // 64] * 64 + pos % 64
            kv.write(0, slots, torch.randn(end, H_KV, D).to(dtype), torch.randn(end, H_KV, D).to(dtype))
            q = torch.randn(n + pad, H, D).to(dtype)
            out = kv.prefill_attention(0, q, table, start, D ** -0.5, valid=n)
            assert torch.isfinite(out).all(), f"{name}: non-finite output (padding rows included)"
            k, v = kv.gather(0, table, end, dtype)
            k = k.transpose(0, 1).repeat_interleave(H // H_KV, 0).float()
            v = v.transpose(0, 1).repeat_interleave(H // H_KV, 0).float()
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
            ref = F.scaled_dot_product_attention(q[:n].transpose(0, 1).float(), k, v, attn_mask=mask,
                                                 scale=D ** -0.5).transpose(0, 1)
            err = max(err, ((out[:n].float() - ref).norm() / ref.norm()).item())
        worst[f"{name}/{str(dtype)[6:]}"] = err
bad = {k: v for k, v in worst.items() if v > (1e-5 if k.endswith("float32") else 1e-2)}
print(worst)

# The launch configuration changes time, not bits: a row's result does not depend on which rows
# share its program (hpc_kernels.paged_prefill.CONFIGS), at the 27B model's heads of 256.
assert paged_prefill.launch_config(256, 448) == paged_prefill.CONFIGS[(0, 0)]
assert paged_prefill.launch_config(256, 512)["block_m"] == 128
assert paged_prefill.launch_config(128, 4096) == paged_prefill.CONFIGS[(0, 0)]
shipped = dict(paged_prefill.CONFIGS)
H, H_KV, D = 24, 4, 256
start, n = 64, (8 if DEV == "cpu" else 200)
for name in (("int8-g64", "nvfp4-g16") if DEV == "cpu" else ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4")):
    kv = PagedKVStorage(kv_profile(name), 1, H_KV, D, 8, device=DEV)
    table = torch.randperm(8)[:(start + n + 63) // 64]
    pos = torch.arange(start + n)
    kv.write(0, table[pos // 64] * 64 + pos % 64, torch.randn(start + n, H_KV, D), torch.randn(start + n, H_KV, D))
    q = torch.randn(n, H, D).to(torch.float32 if DEV == "cpu" else torch.bfloat16)
    outs = []
    # the two configurations, then key tiles of half a page (other sums, the same attention)
    for cfg in (shipped[(0, 0)], shipped[(256, 512)], dict(shipped[(0, 0)], block_n=32)):
        with paged_prefill.every_pass_with(cfg):
            outs.append(kv.prefill_attention(0, q, table, start, D ** -0.5))
    if not torch.equal(outs[0], outs[1]):
        bad[f"{name}/configs differ"] = (outs[0].float() - outs[1].float()).abs().max().item()
    half = outs[2]
    rel = ((half.float() - outs[0].float()).norm() / outs[0].float().norm()).item()
    if rel > (1e-5 if DEV == "cpu" else 1e-2):
        bad[f"{name}/half-page tiles"] = rel
print(bad or "configurations agree")
sys.exit(1 if bad else 0)
