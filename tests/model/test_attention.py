"""The prefill attention's gather path (``hpc_cli.model.attention.prefill_attention``, the CPU's
and a third-party KV format's): a pass's queries over the lane's keys, causal inside the pass,
GQA without repeated K/V. Checked against an fp64 product written out head by head, and against
the per-head SDPA form it replaced (the query heads of a KV head folded into one product's rows:
each row's sums are the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hpc_cli.plugins import kv_profile
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.model.attention import prefill_attention

PAGE = 64


def _setup(heads: int, kv_heads: int, d: int, start: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    end = start + t
    pages = -(-end // PAGE)
    kv = PagedKVStorage(kv_profile("bf16"), 1, kv_heads, d, pages + 2)
    table = torch.arange(2, pages + 2)  # not the first pages: the table is followed
    k = torch.randn(end, kv_heads, d, generator=g)
    v = torch.randn(end, kv_heads, d, generator=g)
    slots = table[torch.arange(end) // PAGE] * PAGE + torch.arange(end) % PAGE
    kv.write(0, slots, k, v)
    q = torch.randn(t, heads, d, generator=g)
    attn = SimpleNamespace(n_heads=heads, n_kv=kv_heads, scale=d ** -0.5)
    keys, values = kv.gather(0, table, end, torch.float32)  # what the pool holds (bf16)
    return attn, kv, table, q, keys, values


def _fp64(attn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    t, h, _ = q.shape
    out = torch.empty(t, h, q.shape[-1], dtype=torch.float64)
    group = attn.n_heads // attn.n_kv
    for head in range(h):
        k, v = keys[:, head // group].double(), values[:, head // group].double()
        for r in range(t):
            s = (q[r, head].double() @ k[:start + r + 1].T) * attn.scale
            out[r, head] = torch.softmax(s, -1) @ v[:start + r + 1]
    return out


@pytest.mark.parametrize("heads,kv_heads,d,start,t", [
    (8, 2, 32, 0, 70), (8, 2, 32, 64, 1), (8, 2, 32, 100, 37), (6, 6, 16, 130, 64), (12, 4, 64, 200, 129),
])
def test_prefill_attention_equals_the_product_written_out(heads, kv_heads, d, start, t):
    attn, kv, table, q, keys, values = _setup(heads, kv_heads, d, start, t)
    out = prefill_attention(attn, q, kv, 0, table, start)
    assert out.shape == (t, heads, d)
    torch.testing.assert_close(out.double(), _fp64(attn, q, keys, values, start), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,start,t", [(8, 2, 64, 1), (8, 2, 100, 37), (24, 4, 300, 200)])
def test_folded_heads_after_cached_keys_equal_the_per_head_form(heads, kv_heads, start, t):
    """The query heads of a KV head as rows of one product: the per-head SDPA with its mask,
    within fp32 rounding (on the 2-core CPUs seen, bit for bit)."""
    attn, kv, table, q, keys, values = _setup(heads, kv_heads, 32, start, t, seed=1)
    end = start + t
    mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None])[None, None]
    per_head = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], attn_mask=mask, scale=attn.scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(prefill_attention(attn, q, kv, 0, table, start), per_head, rtol=1e-6, atol=1e-6)
