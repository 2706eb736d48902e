"""DFlash and DFlash2 block-diffusion drafters (small, seeded for builtin models; docs/speculative.md).

DFlash: target hidden features from chosen layers (the residual stream after ``target_layers``,
concatenated) go through ``fc`` and ``hidden_norm`` into one context vector per position. Each
drafter layer (Qwen3-style: RMSNorm, attention with q/k norms and full rotary, SwiGLU MLP)
projects that vector to its context K/V, kept per position in the backend's own BF16 paged pool
(its pages join the block bundle: same page ids as the main pool). A round drafts a block of
``k + 1`` positions ``[next_token, MASK x k]`` in ONE forward: block queries attend to every
context K/V before the block and, non-causally, to the whole block; the target's ``lm_head``
over the final norm gives the drafts at block positions 1..k. A drafter with ``anchor_drafts``
drafts from the block's first column as well: the block is ``[next_token, MASK x (k - 1)]``, its
first column reads what MTP reads (the token's embedding and the target's final hidden at the
position before, normed and combined by ``anchor_fc``) and drafts the token after it, the mask
columns the ones after that.

DFlash2 differs in three places: its layers attend over a sliding window of ``window`` context
positions held in local rings (``[layers, K|V, window, 2*kv_heads, head_dim/2]`` BF16 per lane)
that live in the state image (StateSlots extra part ``dflash2_ring``, so taps, endpoints and
restores carry them); each layer mixes neighbouring block columns with a dynamic 2-tap
convolution (per-column tap weights from a softmax over a projection of the column); and the
drafts come from a low-rank candidate selector (the ``lm_head`` top-``candidates`` rescored by
``(A h) . (B embed(c))``, rank ``selector_rank``).

On CUDA (where the main model decodes through graphs) the block forward replays from a graph per
lanes x page-table width x ``k`` (:mod:`hpc_cli.speculative.draft_graphs`), the context read on
the device (DFlash: its pool through a padded page table; DFlash2: the whole rings, masked), and
a round's catch-up runs with the state commit in the round's tail graph (:meth:`DFlashDrafter.
catch_up_columns`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.model.layers import MLP, Linear, RMSNorm, Rotary, fused, norm_rope
from hpc_cli.spec_backend import BackendPoolSpec
from hpc_cli.speculative.draft_graphs import INPUT_COLUMNS, DraftGraphs, no_draft_accepted, warm_proposals
from hpc_cli.speculative.ops import column_writes, padded_rows, padded_table
from hpc_kernels import block_attention, candidate_select, dynamic_conv, ring_write

if TYPE_CHECKING:
    from hpc_cli.model.merged import MergedProjection

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
    #: the block's first column reads the target's last hidden beside the token (MTP's input) and
    #: drafts the first token; the block is ``k`` columns ``[next_token, MASK x (k - 1)]``
    anchor_drafts: bool = False


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


@dataclass
class DraftContext:
    """Where one drafter layer's context K/V lies for a block's lanes: pages ``[pages,
    rows_per_page, kv heads, head dim]`` (any page and row strides, the same for K and V) and each
    lane's pages ``table`` ``[B, W]``, spanning ``rows`` context rows. DFlash's pool is its BF16
    pages and the padded page table; DFlash2's rings are one page a lane (the table its state
    slots); a dense ``[B, kv, S, d]`` context (:meth:`of_dense`) is one page a lane too."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    rows: int

    @property
    def rows_per_page(self) -> int:
        return self.k.shape[1]

    @classmethod
    def of_dense(cls, k: torch.Tensor, v: torch.Tensor) -> "DraftContext":
        """A dense context ``[B, kv, S, d]`` (a lane's rows as its one page)."""
        B, S = k.shape[0], k.shape[2]
        return cls(k.transpose(1, 2), v.transpose(1, 2), torch.arange(B, device=k.device)[:, None], S)

    def attends_in_place(self, q: torch.Tensor) -> bool:
        """Whether the block's attention reads this context in place (the fused kernel: a context
        of at most :data:`hpc_kernels.block_attention.MAX_CONTEXT` rows, in ``q``'s dtype)."""
        return (fused(q) and self.k.dtype == q.dtype and self.k.stride() == self.v.stride()
                and block_attention.supports(self.rows, q.shape[-1], q.dtype))

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The context gathered ``[B, kv, rows, d]`` in ``dtype`` (torch's attention reads it)."""
        k, v = (block_attention.gather_context(x, self.table, self.rows).transpose(1, 2).to(dtype)
                for x in (self.k, self.v))
        return k, v


def _add_norm(norm: RMSNorm, x: torch.Tensor, r: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + r, norm(x + r))`` in one launch where the fused kernels run; ``(x, norm(x))`` with no ``r``."""
    return (x, norm(x)) if r is None else norm.add(x, r)


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
        #: q, k and v as one product (:mod:`hpc_cli.model.merged`), set by :meth:`DFlashNet.merge`
        self.merged: "MergedProjection | None" = None

    def qkv(self, x: torch.Tensor, cos, sin):
        """``x`` ``[N, hidden]`` -> q ``[N, heads, d]``, k and v ``[N, kv heads, d]`` (q and k normed
        and rotated, one launch each where the fused kernels run)."""
        n = x.shape[0]
        q, k, v = self.merged(x) if self.merged is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        return (norm_rope(self.q_norm, q.view(n, self.n_heads, self.head_dim), cos, sin),
                norm_rope(self.k_norm, k.view(n, self.n_kv, self.head_dim), cos, sin),
                v.view(n, self.n_kv, self.head_dim))

    def kv(self, x: torch.Tensor, cos, sin):
        """The context K and V of :meth:`qkv` (merged, the one product also yields q, unused)."""
        n = x.shape[0]
        _, k, v = self.merged(x) if self.merged is not None else (None, self.k_proj(x), self.v_proj(x))
        return norm_rope(self.k_norm, k.view(n, self.n_kv, self.head_dim), cos, sin), v.view(n, self.n_kv, self.head_dim)


class DynamicConv2(nn.Module):
    """DFlash2's dynamic 2-tap convolution over the block: ``y_t = a_t x_t + b_t x_{t-1}`` with
    ``(a_t, b_t) = softmax(W x_t)`` per column, then ``o_proj``."""

    def __init__(self, h: int, device=None, dtype=None) -> None:
        super().__init__()
        self.taps = Linear(h, 2, device=device, dtype=dtype)
        self.o_proj = Linear(h, h, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        w = self.taps.weight
        if w is not None and fused(x, w):  # the taps, their softmax and the mix in one launch
            return self.o_proj(dynamic_conv.dynamic_conv(x, w))
        return self.o_proj(dynamic_conv.dynamic_conv_ref(x, w, taps=self.taps(x)))


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
        if cfg.anchor_drafts:  # the first column's input, as MTP's combine
            self.anchor_fc = Linear(2 * h, h, **fk)
            self.anchor_embed_norm = RMSNorm(h, cfg.rms_norm_eps, **fk)
            self.anchor_hidden_norm = RMSNorm(h, cfg.rms_norm_eps, **fk)
        if cfg.kind == "dflash2":
            self.selector_a = Linear(h, cfg.selector_rank, **fk)
            self.selector_b = Linear(h, cfg.selector_rank, **fk)

    def merge(self) -> int:
        """Multiply each layer's q, k and v, and its MLP's gate and up, as one product each
        (:mod:`hpc_cli.model.merged`: the parts' weights become views of the merged rows, the
        state dict is unchanged); returns the products saved a layer pass."""
        from hpc_cli.model.merged import merge, merge_projections

        saved = merge_projections(self)  # the MLPs
        for layer in self.layers:
            attn = layer.self_attn
            if attn.merged is None:
                attn.merged = merge((attn.q_proj, attn.k_proj, attn.v_proj))
                saved += 2 if attn.merged is not None else 0
        return saved

    def anchor_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """An anchor-drafting block's first column from its token's embedding and the target's
        last hidden before it (MTP's ``combine``, with this drafter's own weights)."""
        return self.anchor_fc(torch.cat([self.anchor_embed_norm(embeds),
                                         self.anchor_hidden_norm(hidden.to(embeds.dtype))], -1))


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
        net.merge()  # fewer products a block forward and a catch-up
        self.capture = tuple(net.cfg.target_layers)
        self.rotary = Rotary(self.cfg.head_dim, self.cfg.rope_theta, device=model.device)
        self.pool = None
        self.storage = None
        self.states = None
        self.graphs: DraftGraphs | None = None  # the captured proposals (CUDA, where decode runs graphs)
        #: per context and block width of a graph's proposal the column index of :meth:`_read_keys`
        self._key_columns: dict[tuple[int, int], torch.Tensor] = {}
        #: where the weights came from, for a persisted cache's fingerprint: a checkpoint directory,
        #: ``builtin:tiny/KIND`` or ``seeded:SEED`` (set by the backend that builds the drafter)
        self.source: str | None = None

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
        from hpc_cli.model.graphs import ColumnGraphs

        self.storage, self.states = storage, states
        if self.cfg.kind == "dflash":
            assert backend_storage is not None and backend_storage.num_layers == self.cfg.num_layers
            self.pool = backend_storage
        else:
            assert RING_PART in states.extra, "state slots lack the DFlash2 rings"
        # the block's forward replays as one graph where the main model's decode does
        self.graphs = DraftGraphs(self.model.device) if ColumnGraphs.wanted(self.model, storage) else None

    def admitted(self, lane) -> None:
        lane.backend_frontier = lane.pos  # context K/V of [0, pos) came with the blocks and the tail/image

    # ------------------------------------------------------------------ context K/V
    @torch.inference_mode()
    def observe(self, lane, start: int, n: int, hidden, features: torch.Tensor, pre_hidden, *, extend: bool) -> None:
        """Write the context K/V of positions ``[start, start+n)`` (committed columns only)."""
        if n <= 0:
            return
        m, net, dev = self.model, self.net, self.model.device
        ctx = self._context_vectors(features[:n])
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

    def _context_vectors(self, features: torch.Tensor) -> torch.Tensor:
        """One context vector per position from the target's captured features ``[n, F]``."""
        return self.net.hidden_norm(self.net.fc(features.to(self.model.dtype)))

    @property
    def catches_up_columns(self) -> bool:
        """Whether :meth:`catch_up_columns` serves this drafter's pool (DFlash: a pool whose writes
        skip negative slots; DFlash2: its rings, always)."""
        return self.cfg.kind == "dflash2" or (self.pool is not None and self.pool.skips_negative_slots)

    #: positions a lane's context K/V stays behind its committed tokens after a catch-up
    columns_behind = 0

    @torch.inference_mode()
    def catch_up_columns(self, out, accepted: torch.Tensor) -> torch.Tensor | None:
        """A round's catch-up on the device: for every lane the context K/V of its ``accepted[b] +
        1`` committed positions ``start .. start + accepted[b]`` from the verify pass ``out``'s
        captured features (DFlash: into the pool at the pass's write slots, the columns past a
        lane's count written to slot -1, which the pool skips; DFlash2: into the lane's rings, the
        columns past its count left as they are, returning what every column's ring slot held,
        one launch a layer where the fused kernels run: :mod:`hpc_kernels.ring_write`), which
        :meth:`observe` of the round does lane by lane. No host value is read, so the runtime
        captures it with the round's commit (:mod:`hpc_cli.speculative.round_tail`)."""
        idx = out.index
        B, T = idx.B, idx.T
        ctx = self._context_vectors(out.features.reshape(B * T, -1))
        if self.cfg.kind == "dflash":
            pos, _, slots = column_writes(idx, T, accepted + 1)  # the accepted drafts and the column before
            cos, sin = self.rotary.cos_sin(pos.reshape(-1), self.model.dtype)
            for l, layer in enumerate(self.net.layers):
                k, v = layer.self_attn.kv(ctx, cos, sin)
                self.pool.write(l, slots.reshape(-1), k, v)
            return None
        rings = self.states.extra[RING_PART]
        pos = idx.seqlens[:, :T] - 1  # the lengths are positions + 1
        cos, sin = self.rotary.cos_sin(pos.reshape(-1), self.model.dtype)
        # a layer's ring writes and what they overwrite: one launch where the fused kernels run
        write = ring_write.ring_write if fused(ctx) else ring_write.ring_write_ref
        saved = torch.empty(B, T, *rings.shape[1:3], *rings.shape[4:], dtype=rings.dtype, device=rings.device)
        for l, layer in enumerate(self.net.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            write(rings, l, idx.slots, idx.seqlens, accepted + 1, k, v, saved)
        return saved

    def _ring_columns(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2: the ring slot of each column of the verify index ``idx`` (``[B, 1]`` state
        slots, ``[B, T]`` places in the window)."""
        return idx.slots[:, None], (idx.seqlens - 1) % self.cfg.window  # the lengths are positions + 1

    @torch.inference_mode()
    def undo_catch_up(self, out, saved: torch.Tensor, accepted: list[int]) -> None:
        """Put back what :meth:`catch_up_columns` wrote past each lane's ``accepted[b] + 1``
        committed columns (it ran with larger counts; ``saved`` is what it returned, DFlash2's
        only): a ring slot holds an older position that later rounds still read. DFlash's pool
        returns nothing to undo (what lies past a lane's frontier is overwritten before it is
        read)."""
        T = out.index.T
        dev = saved.device
        past = torch.arange(T, device=dev)[None, :] > torch.tensor(accepted, device=dev)[:, None]  # [B, T]
        where = self._ring_columns(out.index)
        view = self.states.extra[RING_PART].permute(0, 3, 1, 2, 4, 5)  # [N, W, layers, K|V, heads, dim]
        view.index_put_(where, torch.where(past[..., None, None, None, None], saved, view[where]))

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
        m, dev = self.model, self.model.device
        rings = self.states.extra[RING_PART]
        last = max(t.position for t in taps)
        ctx = self._context_vectors(features[:last - start])
        pos = torch.arange(start, last, device=dev)
        cos, sin = self.rotary.cos_sin(pos, m.dtype)
        for tap in taps:
            n = tap.position - start
            assert 0 < n <= last - start, f"tap at {tap.position} outside the pass from {start}"
            rings[tap.slot].copy_(rings[lane.state_slot])
            self._write_ring(rings[tap.slot], ctx[:n], pos[:n], cos[:n], sin[:n])

    def _context(self, lanes, l: int) -> DraftContext:
        """Where layer ``l``'s context K/V lies for ``lanes`` (the eager proposal): DFlash's pool
        through the lanes' own pages, DFlash2's ring slots up to the longest context (a context
        shorter than the window neither copies nor attends to the empty rest)."""
        dev = self.model.device
        if self.cfg.kind == "dflash":
            table, _ = padded_table([l_.pages for l_ in lanes], [max(0, l_.pos - 1) for l_ in lanes],
                                    self.pool.page_tokens, dev)
            return self._context_at(l, table, None)
        slots = torch.tensor([l_.state_slot for l_ in lanes], dtype=torch.long, device=dev)
        used = min(self.cfg.window, max(1, max(l_.pos for l_ in lanes)))
        return self._context_at(l, None, slots, used)

    def _context_at(self, l: int, table: torch.Tensor | None, slots: torch.Tensor | None,
                    used: int | None = None) -> DraftContext:
        """Where layer ``l``'s context K/V lies, from device indices only (what a graph captures):
        DFlash's pool pages through the padded page table ``table`` ``[B, W]``, DFlash2's rings of
        the state slots ``slots`` (a page a lane), their first ``used`` slots (all by default).
        Context slot ``j`` is read where ``j`` is below the block's position (:meth:`_read_keys`):
        in the pool that is the position itself; in a ring, slot ``j`` holds a position ``q = j``
        modulo the window with ``q`` below the block's, which exists exactly where ``j`` is below
        it."""
        if self.cfg.kind == "dflash":
            pages = self.pool.bf16_pages(l)
            assert pages is not None, "a DFlash pool stores BF16"
            return DraftContext(*pages, table, table.shape[1] * self.pool.page_tokens)
        rings = self.states.extra[RING_PART]
        return DraftContext(rings[:, l, 0], rings[:, l, 1], slots[:, None],
                            self.cfg.window if used is None else used)

    def _read_keys(self, S: int, T: int, pos: torch.Tensor, held: bool = False) -> torch.Tensor:
        """The keys a block's queries read ``[B, 1, 1, S + T]``: the ``S`` context slots below each
        lane's block position ``pos`` ``[B]``, then all ``T`` of the block's own (non-causal): one
        comparison against a column index (``-1`` at the block's columns). ``held``: the index is
        kept per shape (the graphs' shapes, a bounded set; made at the warm-up's eager pass of each,
        never inside a capture, and kept for as long as the drafter, since graphs read it), else
        made in place (the eager path's widths follow the lanes' positions)."""
        cols = self._key_columns.get((S, T)) if held else None
        if cols is None:
            dev = pos.device
            cols = torch.cat([torch.arange(S, device=dev), torch.full((T,), -1, dtype=torch.long, device=dev)])
            if held and not (cols.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._key_columns[(S, T)] = cols
        return (cols[None] < pos[:, None])[:, None, None, :]

    # ------------------------------------------------------------------ drafting
    def _block(self, next_tokens: torch.Tensor, pos: torch.Tensor, k: int, context,
               slots: torch.Tensor | None = None, graphed: bool = False) -> torch.Tensor:
        """The drafts ``[B, k]`` (on the device) of one block forward (:meth:`_block_hidden`, then
        :meth:`_drafts`)."""
        return self._drafts(self._block_hidden(next_tokens, pos, k, context, slots, graphed))

    def _block_hidden(self, next_tokens: torch.Tensor, pos: torch.Tensor, k: int, context,
                      slots: torch.Tensor | None = None, graphed: bool = False) -> torch.Tensor:
        """The final hidden ``[B, k, H]`` of the drafting columns of one block forward: per lane ``[next_token,
        MASK x k]`` at positions ``pos[b] ..`` (``next_tokens``, ``pos`` ``[B]`` on the device),
        each layer reading its context K/V where ``context(layer)`` (a :class:`DraftContext`) says
        it lies: in place in one launch where the fused kernels run
        (:mod:`hpc_kernels.block_attention`), else gathered for torch's attention. With
        ``anchor_drafts`` the block is ``[next_token, MASK x (k - 1)]`` and its first column also
        reads the lanes' last hidden from their state ``slots`` ``[B]``. A block of one column
        (``k`` = 1, anchored) builds no token or position rows; each residual sum goes into the
        next norm's launch (:meth:`RMSNorm.add`). ``graphed``: a graph's proposal (the keys'
        column index held, :meth:`_read_keys`)."""
        m, net, cfg = self.model, self.net, self.cfg
        dev = next_tokens.device
        B, T = next_tokens.shape[0], k if cfg.anchor_drafts else k + 1
        if T == 1:
            toks, cols = next_tokens, pos
        else:
            toks = torch.cat([next_tokens[:, None],
                              torch.full((B, T - 1), cfg.mask_token_id, dtype=torch.long, device=dev)], 1).reshape(-1)
            cols = (pos[:, None] + torch.arange(T, device=dev)).reshape(-1)
        cos, sin = self.rotary.cos_sin(cols, m.dtype)
        x = m._embed(toks)  # [B*T, H]
        if cfg.anchor_drafts:
            assert slots is not None, "an anchor-drafting block reads the lanes' last hidden from their slots"
            hidden = self.states.hidden.index_select(0, slots)
            if T == 1:
                x = net.anchor_input(x, hidden)
            else:
                x = x.view(B, T, -1)
                x = torch.cat([net.anchor_input(x[:, 0], hidden)[:, None], x[:, 1:]], 1).reshape(B * T, -1)
        mask = None
        r = None  # a residual branch not yet added to x: added in the next norm's launch
        for l, layer in enumerate(net.layers):
            if cfg.kind == "dflash2":
                x, h = _add_norm(layer.conv_norm, x, r)
                r = layer.dconv(h.view(B, T, -1)).reshape(B * T, -1)
            x, h = _add_norm(layer.input_layernorm, x, r)
            attn = layer.self_attn
            q, kb, vb = attn.qkv(h, cos, sin)
            ctx = context(l)
            if ctx.attends_in_place(q):  # one launch, the context read where it lies
                o = block_attention.block_attention(q, kb, vb, ctx.k, ctx.v, ctx.table, ctx.rows_per_page, pos,
                                                    ctx.rows)
            else:
                kc, vc = ctx.dense(q.dtype)
                if mask is None:
                    mask = self._read_keys(kc.shape[2], T, pos, held=graphed)
                q = q.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
                kb = kb.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
                vb = vb.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
                keys = torch.cat([kc, kb], dim=2)
                vals = torch.cat([vc, vb], dim=2)
                # non-causal in the block; grouped queries read their K/V head in place (a repeated
                # copy of a long context would be ``num_heads / num_kv_heads`` times its size)
                o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask,
                                                   enable_gqa=cfg.num_heads > cfg.num_kv_heads).transpose(1, 2)
            x, h = layer.post_attention_layernorm.add(x, attn.o_proj(o.reshape(B * T, -1)))
            r = layer.mlp(h)
        _, hid = _add_norm(net.norm, x, r)
        return hid.view(B, T, -1)[:, T - k:]  # [B, k, H]: the drafting columns

    def _drafts(self, hid: torch.Tensor) -> torch.Tensor:
        """The drafts ``[B, k]`` of the block's final hidden ``hid`` ``[B, k, H]``: the target's
        ``lm_head`` argmax, or DFlash2's candidate selector over its top ``candidates`` (one launch
        after the ``lm_head`` where the fused kernels run: :mod:`hpc_kernels.candidate_select`)."""
        m, net, cfg = self.model, self.net, self.cfg
        logits = m.lm_head(hid)
        if cfg.kind == "dflash2" and cfg.candidates > 1:
            B, k, V = logits.shape
            c = min(cfg.candidates, V)
            wa, wb, embed = net.selector_a.weight, net.selector_b.weight, m.embed_tokens.weight
            if (candidate_select.supports(V, c) and embed is not None and wa is not None and wb is not None
                    and fused(hid, wa, wb, embed)):  # the whole selector in one launch
                return candidate_select.select(logits.view(B * k, V), hid.reshape(B * k, -1), wa, wb, embed, c,
                                               1 / math.sqrt(cfg.selector_rank)).view(B, k)
            top = logits.topk(c, dim=-1)  # [B, k, c]
            qa = net.selector_a(hid)  # [B, k, r]
            emb = m._embed(top.indices.reshape(-1)).view(*top.indices.shape, -1)
            dot = torch.matmul(net.selector_b(emb), qa[..., None])[..., 0]  # [B, k, c]: (B e_c) . (A h)
            score = torch.add(top.values.float(), dot.float(), alpha=1 / math.sqrt(cfg.selector_rank))
            return top.indices.gather(-1, score.argmax(-1, keepdim=True))[..., 0]
        return logits.argmax(-1)

    @torch.inference_mode()
    def propose(self, lanes, k: int, states) -> list[list[int]]:
        return self.propose_device(lanes, k, states).tolist()

    @torch.inference_mode()
    def propose_device(self, lanes, k: int, states) -> torch.Tensor:
        """:meth:`propose`'s drafts ``[B, k]`` left on the device (the block forward and the verify
        pass queue without a wait); from a graph where the drafter has them (its static buffer:
        read it within the round)."""
        if self.graphs is not None:
            return self._propose_packed(lanes, k)
        dev = self.model.device
        nxt = torch.tensor([l.next_token for l in lanes], dtype=torch.long, device=dev)
        pos = torch.tensor([l.pos for l in lanes], dtype=torch.long, device=dev)
        slots = (torch.tensor([l.state_slot for l in lanes], dtype=torch.long, device=dev)
                 if self.cfg.anchor_drafts else None)
        return self._block(nxt, pos, k, lambda l: self._context(lanes, l), slots)

    # ------------------------------------------------------------------ drafting in a graph
    def _steps(self, packed: torch.Tensor, W: int, k: int) -> torch.Tensor:
        """The block forward of :meth:`propose` on packed inputs on the device (each lane's next
        token, state slot, position, an unused column, then DFlash's page table of width ``W``;
        :data:`~hpc_cli.speculative.draft_graphs.INPUT_COLUMNS`): the drafts ``[B, k]``, computed
        without reading anything back to the host (capturable)."""
        return self._block(packed[:, 0], packed[:, 2], k,
                           lambda l: self._context_at(l, packed[:, INPUT_COLUMNS:], packed[:, 1]),
                           packed[:, 1], graphed=True)

    def _propose_packed(self, lanes, k: int) -> torch.Tensor:
        """:meth:`propose` through :class:`~hpc_cli.speculative.draft_graphs.DraftGraphs`: the
        round's inputs packed into one pinned host tensor, the block forward replayed from a graph
        per lanes x page-table width (DFlash; a decode graph's width, so many context lengths
        share one) x ``k``."""
        assert self.graphs is not None, "packed proposals need the drafter's graphs"
        table, W = self._table(lanes, [max(0, l.pos - 1) for l in lanes])
        head = self.graphs.pack([[l.next_token, l.state_slot, l.pos, 0, *row] for l, row in zip(lanes, table)])
        return self.graphs.run(self._key(len(lanes), W, k), head, lambda p: self._steps(p, W, k))

    def _table(self, lanes, last: list[int]) -> tuple[list, int]:
        """DFlash: the context's pages through position ``last[b]``, padded to a decode graph's
        width, and that width; DFlash2 (its context in the rings): empty rows, width 0."""
        if self.cfg.kind != "dflash":
            return [()] * len(lanes), 0
        return padded_rows([l.pages for l in lanes], last, self.pool.page_tokens, graph=True)

    def _key(self, B: int, W: int, k: int) -> tuple:
        return DraftGraphs.key(B, W, k, self.pool if self.pool is not None else self.storage, self.states, 0)

    # ------------------------------------------------------------------ the next round's proposal, ahead
    @torch.inference_mode()
    def propose_ahead(self, lanes, k: int, verdict: torch.Tensor, states=None) -> torch.Tensor | None:
        """The next round's drafts ``[B, k]``, proposed on the device behind this round's verify
        pass and tail (which counted the accepted drafts and wrote their context K/V), before the
        host reads the verdict: each lane's next token and position come from ``verdict``
        (:func:`~hpc_cli.speculative.draft_graphs.ahead_inputs`), so they are what the packed
        proposal reads after a round whose lanes all stop where the device counted (the runtime
        uses the drafts only then). DFlash's page table reaches as far as a round accepting every
        draft, in the width of one accepting none (the drafts are the packed proposal's bit for
        bit); None where those widths differ, a lane lacks the pages, or proposals run eagerly
        (their context's width follows the lanes' positions, which only the host's count gives)."""
        if self.graphs is None:
            return None
        page = self.pool.page_tokens if self.pool is not None else PAGE_TOKENS
        last = [l.pos + k for l in lanes]  # the context's last position after k accepted drafts
        if self.cfg.kind == "dflash" and any(len(l.pages) * page <= p for l, p in zip(lanes, last)):
            return None
        table, W = self._table(lanes, last)
        if self._table(lanes, [p - k for p in last])[1] != W:
            return None
        rows = [[0, l.state_slot, l.pos + 1, 0, *row] for l, row in zip(lanes, table)]
        return self.graphs.run_ahead(self._key(len(lanes), W, k), self.graphs.pack(rows), verdict,
                                     lambda p: self._steps(p, W, k))

    def took_ahead(self, lanes) -> None:
        """A round's proposal is made (here or ahead): DFlash's moves no frontier."""

    @torch.inference_mode()
    def warm(self, batches, widths, k: int, states, num_pages: int, max_model_len: int) -> int:
        """Compile and capture the proposal of every ``batches`` x ``1..k`` drafts (x ``widths``
        for DFlash, whose context is paged) before serving, on the engine's worker thread (the
        forward reads the pool and the rings, writes nothing). Returns the shapes warmed (none
        without graphs)."""
        if self.graphs is None:
            return 0

        def place(W: int, drafts: int) -> tuple[int, int]:  # a context of W pages
            pos = max(1, min(W * PAGE_TOKENS, max_model_len - 1 - k))
            return pos, max(1, math.ceil(pos / PAGE_TOKENS))

        return warm_proposals(self._propose_packed, batches, widths if self.cfg.kind == "dflash" else [1], k,
                              num_pages, place,
                              lambda lanes, drafts: self.propose_ahead(
                                  lanes, drafts, no_draft_accepted(len(lanes), drafts, self.model.device)))
