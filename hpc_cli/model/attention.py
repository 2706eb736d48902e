"""Qwen3.5's gated full attention over paged KV (HF ``self_attn``).

``q_proj`` yields per head ``[query | gate]`` (interleaved per head, ``2 * head_dim``); q and k
get the zero-centred RMSNorm over ``head_dim``; rotary on the first ``rotary_dim`` dims; the
attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. New K and V are written
into the pages in the active KV profile's format, and every K and V the queries read (old and
new alike) comes back dequantised from the pages, so a split prefill, an unsplit one and
decode all see the same stored values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.model.layers import Linear, RMSNorm, norm_rope

if TYPE_CHECKING:
    from hpc_cli.model.merged import MergedProjection
    from hpc_kernels.split_sums import SplitSums


class GatedAttention(nn.Module):
    def __init__(self, cfg, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(h, self.n_heads * self.head_dim * 2, bias=bias, **fk)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=bias, **fk)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=bias, **fk)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias, **fk)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, **fk)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, **fk)
        self.scale = self.head_dim ** -0.5
        #: q, k and v as one product (:mod:`hpc_cli.model.merged`), set once the weights are loaded
        self.merged: "MergedProjection | None" = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[N, hidden]`` -> q ``[N, H, d]``, gate ``[N, H*d]``, k, v ``[N, H_kv, d]`` (k, q rotated)."""
        n = x.shape[0]
        if self.merged is not None:
            qg, k, v = self.merged(x)
            k = norm_rope(self.k_norm, k.view(n, self.n_kv, self.head_dim), cos, sin)
            v = v.view(n, self.n_kv, self.head_dim)
        else:
            qg = self.q_proj(x)
            k, v = self.kv(x, cos, sin)
        q, gate = torch.chunk(qg.view(n, self.n_heads, 2 * self.head_dim), 2, dim=-1)
        gate = gate.reshape(n, -1)
        return norm_rope(self.q_norm, q, cos, sin), gate, k, v

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, hidden]`` -> the K (normed, rotated) and V ``[N, H_kv, d]`` that :meth:`qkv` gives."""
        n = x.shape[0]
        k = norm_rope(self.k_norm, self.k_proj(x).view(n, self.n_kv, self.head_dim), cos, sin)
        return k, self.v_proj(x).view(n, self.n_kv, self.head_dim)

    def finish(self, attn: torch.Tensor, gate: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        """``attn`` ``[N, H, d]`` -> ``o_proj(attn * sigmoid(gate))``; ``unsummed``: its split sums
        where it has them (:meth:`~hpc_cli.model.layers.Linear.unsummed`)."""
        gated = attn.reshape(attn.shape[0], -1) * torch.sigmoid(gate)
        return self.o_proj.unsummed(gated) if unsummed else self.o_proj(gated)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """``q`` ``[B, H, T, d]``, ``k, v`` ``[B, H_kv, S, d]``, boolean ``mask`` ``[B|1, 1, T, S]`` (True = read)."""
        k, v = self.repeat_kv(k, v)
        return self.attend_heads(q, k, v, mask, causal)

    def repeat_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` ``[B, H_kv, S, d]`` -> ``[B, H, S, d]``: each KV head repeated for the query heads it serves."""
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return k, v

    def attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per row, ``q`` ``[B, H, d]``, over ``k, v`` ``[B, H_kv, S, d]`` with ``mask``
        ``[B, 1, 1, S]``: the query heads of each KV head take the place of query positions in
        one product over that head's keys (head ``h`` reads KV head ``h // (H / H_kv)``, as
        :meth:`repeat_kv`), so no K/V is copied. Returns ``[B, H, d]``."""
        b, h, d = q.shape
        o = F.scaled_dot_product_attention(q.view(b, self.n_kv, h // self.n_kv, d), k, v, attn_mask=mask,
                                           scale=self.scale)
        return o.reshape(b, h, d)

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     causal: bool = False) -> torch.Tensor:
        """:meth:`attend` over K/V already repeated to every query head (:meth:`repeat_kv`)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=self.scale)


def prefill_attention(attn: GatedAttention, q: torch.Tensor, kv, layer: int, pages: torch.Tensor,
                      start: int) -> torch.Tensor:
    """A prefill pass's queries ``q`` ``[T, H, d]`` (positions ``start ..``) over the lane's first
    ``start + T`` keys, gathered dequantised from ``pages`` (the pass's own K/V written first):
    query ``t`` reads keys ``[0, start + t]``. The path where the paged prefill kernel does not
    apply (CPU, a third-party KV format); returns ``[T, H, d]``."""
    t = q.shape[0]
    end = start + t
    keys, values = kv.gather(layer, pages, end, q.dtype)
    if not start:  # causal without a mask; GQA by the kernel itself (no repeated K/V copies)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], is_causal=True, scale=attn.scale,
                                           enable_gqa=attn.n_heads != attn.n_kv)
        return o[0].transpose(0, 1)
    # after cached keys, under a mask: the query heads of each KV head become query rows of one
    # product over that head's keys (as attend_one does for decode), so every key block the
    # kernel loads serves all of them; each row's sums are those of the per-head form (the CPU
    # kernel splits the keys alike whatever the rows), and on the 2-core CPU a cached turn's
    # 512 queries over 4,012 keys took 318-345 ms against 371-426 ms
    g = attn.n_heads // attn.n_kv
    dev = q.device
    positions = torch.arange(start, end, device=dev)
    mask = torch.arange(end, device=dev)[None, :] <= positions[:, None]  # [t, end]
    rows = q.reshape(t, attn.n_kv, g, q.shape[-1]).permute(1, 2, 0, 3).reshape(1, attn.n_kv, g * t, q.shape[-1])
    o = F.scaled_dot_product_attention(rows, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                       attn_mask=mask.repeat(g, 1)[None, None], scale=attn.scale)
    return o[0].view(attn.n_kv, g, t, -1).permute(2, 0, 1, 3).reshape(t, attn.n_heads, -1)
