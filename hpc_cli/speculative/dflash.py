"""DFlash and DFlash2 block-diffusion drafters (small, seeded for builtin models; docs/speculative.md).

DFlash: target hidden features from chosen layers (the residual stream after ``target_layers``,
concatenated) go through ``fc`` and ``hidden_norm`` into one context vector per position. Each
drafter layer (Qwen3-style: RMSNorm, attention with q/k norms and full rotary, SwiGLU MLP)
projects that vector to its context K/V, kept per position in the backend's own BF16 paged pool
(its pages join the block bundle: same page ids as the main pool). A round drafts a block of
``k + 1`` positions ``[next_token, MASK x k]`` in ONE forward: block queries attend to every
context K/V before the block and, non-causally, to the whole block; the target's ``lm_head``
over the final norm gives the drafts at block positions 1..k.

DFlash2 differs in three places: its layers attend over a sliding window of ``window`` context
positions held in local rings (``[layers, K|V, window, 2*kv_heads, head_dim/2]`` BF16 per lane)
that live in the state image (StateSlots extra part ``dflash2_ring``, so taps, endpoints and
restores carry them); each layer mixes neighbouring block columns with a dynamic 2-tap
convolution (per-column tap weights from a softmax over a projection of the column); and the
drafts come from a low-rank candidate selector (the ``lm_head`` top-``candidates`` rescored by
``(A h) . (B embed(c))``, rank ``selector_rank``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.model.layers import MLP, Linear, RMSNorm, Rotary, apply_rotary
from hpc_cli.spec_backend import BackendPoolSpec

RING_PART = "dflash2_ring"


def ring_parts(layers: int, window: int, kv_heads: int,
               head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """DFlash2's part of every state image (``StateSlots`` ``extra_parts``): the local rings
    ``[layers, K|V, window, kv heads, head dim]`` BF16."""
    return {RING_PART: ((layers, 2, window, kv_heads, head_dim), torch.bfloat16)}


@dataclass
class DrafterConfig:
    kind: str  # "dflash" | "dflash2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    window: int = 0  # dflash2: ring positions
    selector_rank: int = 0  # dflash2
    candidates: int = 0  # dflash2


def default_config(kind: str, model, layers: int, window: int = 2048) -> DrafterConfig:
    """A drafter sized after the target (the geometry of plugins/spec_backends.py)."""
    c = model.config
    L = c.num_hidden_layers
    n = min(5, L)
    targets = sorted({min(L - 1, max(0, round(1 + i * (L - 3) / max(1, n - 1)))) for i in range(n)})
    if kind == "dflash":
        heads, kv, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        extra = {}
    else:
        kv, dim = 2 * c.num_key_value_heads, c.head_dim // 2
        heads = 2 * kv
        extra = dict(window=window, selector_rank=min(64, c.hidden_size // 4), candidates=8)
    return DrafterConfig(kind=kind, hidden_size=c.hidden_size, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                         head_dim=dim, intermediate_size=c.intermediate_size or 4 * c.hidden_size,
                         target_layers=targets, mask_token_id=c.vocab_size - 1, rope_theta=c.rope_theta,
                         rms_norm_eps=c.rms_norm_eps, **extra)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        h, self.n_heads, self.n_kv, self.head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(h, self.n_heads * self.head_dim, **fk)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, **fk)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, **fk)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, **fk)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **fk)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **fk)

    def kv(self, x: torch.Tensor, cos, sin):
        n = x.shape[0]
        k = apply_rotary(self.k_norm(self.k_proj(x).view(n, self.n_kv, self.head_dim)), cos, sin)
        return k, self.v_proj(x).view(n, self.n_kv, self.head_dim)

    def q(self, x: torch.Tensor, cos, sin):
        n = x.shape[0]
        return apply_rotary(self.q_norm(self.q_proj(x).view(n, self.n_heads, self.head_dim)), cos, sin)


class DynamicConv2(nn.Module):
    """DFlash2's dynamic 2-tap convolution over the block: ``y_t = a_t x_t + b_t x_{t-1}`` with
    ``(a_t, b_t) = softmax(W x_t)`` per column, then ``o_proj``."""

    def __init__(self, h: int, device=None, dtype=None) -> None:
        super().__init__()
        self.taps = Linear(h, 2, device=device, dtype=dtype)
        self.o_proj = Linear(h, h, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        w = torch.softmax(self.taps(x).float(), dim=-1).to(x.dtype)
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.o_proj(w[..., :1] * x + w[..., 1:] * prev)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
        self.self_attn = DraftAttention(cfg, **fk)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, **fk)
        if cfg.kind == "dflash2":
            self.conv_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
            self.dconv = DynamicConv2(cfg.hidden_size, **fk)


class DFlashNet(nn.Module):
    """The drafter's own weights (embeddings and ``lm_head`` are the target's)."""

    def __init__(self, cfg: DrafterConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layers) * h, h, **fk)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, **fk)
        self.layers = nn.ModuleList([DraftLayer(cfg, **fk) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, **fk)
        if cfg.kind == "dflash2":
            self.selector_a = Linear(h, cfg.selector_rank, **fk)
            self.selector_b = Linear(h, cfg.selector_rank, **fk)


@torch.no_grad()
def seed_weights(net: nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.randn(p.shape, generator=gen) * 0.05
        else:
            t = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t /= math.sqrt(2 * max(1, len(getattr(net, "layers", [1]))))
        p.copy_(t.to(p.dtype))


def save_drafter(net: DFlashNet, path: str) -> None:
    """Write a drafter checkpoint directory: ``config.json`` and ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"hpc_drafter": asdict(net.cfg)}, f, indent=1)
    save_file({k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def load_drafter(path: str, kind: str, device, dtype) -> DFlashNet:
    from safetensors.torch import load_file

    from hpc_cli.errors import ConfigError

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"drafter directory {path!r} has no config.json", hint="point speculative.drafter at one")
    raw = json.load(open(cfg_path)).get("hpc_drafter")
    if raw is None or raw.get("kind") != kind:
        raise ConfigError(f"{cfg_path} is not a {kind} drafter config", hint="speculative.backend must match it")
    cfg = DrafterConfig(**raw)
    net = DFlashNet(cfg, device=device, dtype=dtype)
    state = load_file(os.path.join(path, "model.safetensors"))
    missing = set(net.state_dict()) - set(state)
    if missing:
        raise ConfigError(f"drafter checkpoint {path!r} lacks {sorted(missing)[:3]}", hint="re-export the drafter")
    net.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()})
    return net.eval()


class DFlashDrafter:
    """Drives a :class:`DFlashNet` against the engine's pools (see the module docstring)."""

    needs_hidden = False

    def __init__(self, model, net: DFlashNet) -> None:
        self.model = model
        self.net = net
        self.cfg = net.cfg
        self.name = net.cfg.kind
        self.capture = tuple(net.cfg.target_layers)
        self.rotary = Rotary(self.cfg.head_dim, self.cfg.rope_theta, device=model.device)
        self.pool = None
        self.states = None

    # ------------------------------------------------------------------ geometry
    def pool_spec(self) -> BackendPoolSpec | None:
        """DFlash's own BF16 pool, sized after this drafter (its layers, KV heads and head dim), so
        a drafter checkpoint of any depth gets the pool it reads; DFlash2 has none."""
        c = self.cfg
        return BackendPoolSpec(c.num_layers, c.num_kv_heads, c.head_dim) if c.kind == "dflash" else None

    def state_parts(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The parts this drafter adds to every state image: DFlash2's rings (:func:`ring_parts`),
        sized after it; DFlash adds none."""
        c = self.cfg
        return ring_parts(c.num_layers, c.window, c.num_kv_heads, c.head_dim) if c.kind == "dflash2" else {}

    def bind(self, storage, backend_storage, states) -> None:
        self.states = states
        if self.cfg.kind == "dflash":
            assert backend_storage is not None and backend_storage.num_layers == self.cfg.num_layers
            self.pool = backend_storage
        else:
            assert RING_PART in states.extra, "state slots lack the DFlash2 rings"

    def admitted(self, lane) -> None:
        lane.backend_frontier = lane.pos  # context K/V of [0, pos) came with the blocks and the tail/image

    # ------------------------------------------------------------------ context K/V
    @torch.inference_mode()
    def observe(self, lane, start: int, n: int, hidden, features: torch.Tensor, pre_hidden, *, extend: bool) -> None:
        """Write the context K/V of positions ``[start, start+n)`` (committed columns only)."""
        if n <= 0:
            return
        m, net, dev = self.model, self.net, self.model.device
        ctx = net.hidden_norm(net.fc(features[:n].to(m.dtype)))
        pos = torch.arange(start, start + n, device=dev)
        cos, sin = self.rotary.cos_sin(pos, m.dtype)
        if self.cfg.kind == "dflash":
            page = self.pool.page_tokens
            pages = torch.tensor(lane.pages[:math.ceil((start + n) / page)], dtype=torch.long, device=dev)
            slots = pages.index_select(0, pos // page) * page + pos % page
            for l, layer in enumerate(net.layers):
                k, v = layer.self_attn.kv(ctx, cos, sin)
                self.pool.write(l, slots, k, v)
        else:
            self._write_ring(self.states.extra[RING_PART][lane.state_slot], ctx, pos, cos, sin)
        lane.backend_frontier = start + n

    def _write_ring(self, ring: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor, cos, sin) -> None:
        """DFlash2: the context K/V of positions ``pos`` (consecutive) into ``ring``
        ``[L, 2, W, heads, dim]`` at ``pos % W`` (only the last ``W`` positions land)."""
        W = self.cfg.window
        n = pos.shape[0]
        keep = slice(max(0, n - W), n)
        idx = pos[keep] % W
        for l, layer in enumerate(self.net.layers):
            k, v = layer.self_attn.kv(ctx[keep], cos[keep], sin[keep])
            ring[l, 0].index_copy_(0, idx, k.to(ring.dtype))
            ring[l, 1].index_copy_(0, idx, v.to(ring.dtype))

    #: DFlash2 fills its rings' part of the images a prefill pass takes inside itself
    #: (:meth:`tap_parts`), so its passes need not split at taps
    @property
    def taps_its_parts(self) -> bool:
        return self.cfg.kind == "dflash2"

    @torch.inference_mode()
    def tap_parts(self, lane, start: int, features: torch.Tensor, taps) -> None:
        """The rings of the images the pass over ``[start, ...)`` took inside itself (spec §7.3, a
        ring tap): each tap's slot gets the lane's ring as it stood at the tap's position ``p``,
        the ring before the pass (positions below ``start``, slot ``q % W``) with the pass's
        positions ``[max(start, p - W), p)`` written over it, wrapping round the ring as observe
        does. Call before :meth:`observe` of the pass changes the lane's ring."""
        assert self.taps_its_parts, f"{self.name} keeps no part of the state image to tap"
        if not taps:
            return
        m, net, dev = self.model, self.net, self.model.device
        rings = self.states.extra[RING_PART]
        last = max(t.position for t in taps)
        ctx = net.hidden_norm(net.fc(features[:last - start].to(m.dtype)))
        pos = torch.arange(start, last, device=dev)
        cos, sin = self.rotary.cos_sin(pos, m.dtype)
        for tap in taps:
            n = tap.position - start
            assert 0 < n <= last - start, f"tap at {tap.position} outside the pass from {start}"
            rings[tap.slot].copy_(rings[lane.state_slot])
            self._write_ring(rings[tap.slot], ctx[:n], pos[:n], cos[:n], sin[:n])

    def _context(self, lanes, l: int, dtype):
        """Context K/V ``[B, kv, S, d]`` of layer ``l`` and the mask ``[B, S]`` of valid keys."""
        dev = self.model.device
        if self.cfg.kind == "dflash":
            page = self.pool.page_tokens
            n_pages = [max(1, math.ceil(l_.pos / page)) for l_ in lanes]
            width = max(n_pages)
            rows = [list(l_.pages[:n]) + [l_.pages[0]] * (width - n) for l_, n in zip(lanes, n_pages)]
            table = torch.tensor(rows, dtype=torch.long, device=dev).reshape(-1)
            span = width * page
            k, v = self.pool.gather(l, table, len(lanes) * span, dtype)
            B = len(lanes)
            k = k.view(B, span, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
            v = v.view(B, span, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
            valid = torch.arange(span, device=dev)[None] < torch.tensor([l_.pos for l_ in lanes], device=dev)[:, None]
            return k, v, valid
        W = self.cfg.window
        # ring slot j holds position j until the ring wraps: only the first max(pos) slots are read
        # (a context shorter than the window neither copies nor attends to the empty rest)
        used = min(W, max(1, max(l_.pos for l_ in lanes)))
        slots = torch.tensor([l_.state_slot for l_ in lanes], dtype=torch.long, device=dev)
        ring = self.states.extra[RING_PART][:, l, :, :used].index_select(0, slots)  # [B, 2, used, heads, dim]
        k, v = ring[:, 0].transpose(1, 2).to(dtype), ring[:, 1].transpose(1, 2).to(dtype)
        pos = torch.tensor([l_.pos for l_ in lanes], device=dev)[:, None]
        j = torch.arange(used, device=dev)[None]
        held = pos - 1 - torch.remainder(pos - 1 - j, W)  # the position ring slot j holds
        return k, v, held >= 0

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, lanes, k: int, states) -> list[list[int]]:
        m, net, cfg, dev = self.model, self.net, self.cfg, self.model.device
        B, T = len(lanes), k + 1
        toks = torch.full((B, T), cfg.mask_token_id, dtype=torch.long, device=dev)
        toks[:, 0] = torch.tensor([l.next_token for l in lanes], dtype=torch.long, device=dev)
        pos = torch.tensor([l.pos for l in lanes], dtype=torch.long, device=dev)[:, None] + torch.arange(T, device=dev)
        cos, sin = self.rotary.cos_sin(pos.reshape(-1), m.dtype)
        x = m._embed(toks.reshape(-1))  # [B*T, H]
        rep = cfg.num_heads // cfg.num_kv_heads
        for l, layer in enumerate(net.layers):
            if cfg.kind == "dflash2":
                x = x + layer.dconv(layer.conv_norm(x).view(B, T, -1)).reshape(B * T, -1)
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            q = attn.q(h, cos, sin).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
            kb, vb = attn.kv(h, cos, sin)
            kb = kb.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
            vb = vb.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
            kc, vc, valid = self._context(lanes, l, q.dtype)
            keys = torch.cat([kc, kb], dim=2)
            vals = torch.cat([vc, vb], dim=2)
            mask = torch.cat([valid, torch.ones(B, T, dtype=torch.bool, device=dev)], dim=1)[:, None, None, :]
            if rep > 1:
                keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)  # non-causal in the block
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B * T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hid = net.norm(x).view(B, T, -1)[:, 1:]  # [B, k, H]
        logits = m.lm_head(hid)
        if cfg.kind == "dflash2" and cfg.candidates > 1:
            top = logits.topk(min(cfg.candidates, logits.shape[-1]), dim=-1)  # [B, k, c]
            qa = net.selector_a(hid)  # [B, k, r]
            emb = m._embed(top.indices.reshape(-1)).view(*top.indices.shape, -1)
            kb_ = net.selector_b(emb)  # [B, k, c, r]
            score = top.values.float() + (kb_ * qa[:, :, None]).sum(-1).float() / math.sqrt(cfg.selector_rank)
            best = top.indices.gather(-1, score.argmax(-1, keepdim=True))[..., 0]
        else:
            best = logits.argmax(-1)
        return best.tolist()
