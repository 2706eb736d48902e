"""The Qwen3.5 hybrid model and its execution API (see ``hpc_cli.model`` for the contract)."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.model.attention import GatedAttention, prefill_attention
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.gdn import GatedDeltaNet
from hpc_cli.model.layers import MLP, Linear, RMSNorm, Rotary, param
from hpc_cli.model.moe import SparseMoE

if TYPE_CHECKING:
    from hpc_cli.kv_profile import KVProfile
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.memory.state_pool import StateSlots
    from hpc_cli.model.graphs import PreparedDecode
    from hpc_cli.model.image_processor import ImageProcessorConfig
    from hpc_cli.model.vision import MultimodalConfig, PrefillMedia, VisionTower
    from hpc_cli.shapes import HybridShape


@dataclass(slots=True)
class PrefillOut:
    """``logits``: ``[vocab]`` for the last position, or ``[T, vocab]`` with ``all_logits``.
    ``hidden_last``: ``[hidden]``, the last position's hidden after the final norm (what
    ``lm_head`` reads and what an MTP drafter continues from; also stored in the state slot)."""

    logits: torch.Tensor
    hidden_last: torch.Tensor
    #: ``[T, hidden]`` after the final norm for every position (``all_hidden``; speculative backends)
    hidden: torch.Tensor | None = None
    #: ``[T, len(capture) * hidden]``: the residual stream after each captured layer (DFlash features)
    features: torch.Tensor | None = None
    #: the state images at the pass's ``taps``, in order
    taps: list["TapImage"] = field(default_factory=list)


@dataclass(slots=True)
class TapImage:
    """A state image a prefill pass takes inside itself (the zero-split tap, spec §7.3): the
    state after position ``position``, written into state slot ``slot`` (per GDN layer the conv
    window and the fp32 recurrent state, and the hidden after the final norm at ``position - 1``;
    a speculative backend's parts are not written)."""

    position: int
    slot: int  # a state slot index (the cache's StateSlot; the model layer does not import the cache)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, device=None, dtype=None, host_experts: bool = False,
                 pin: bool = False) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, **fk)
        else:
            self.self_attn = GatedAttention(cfg, **fk)
        self.mlp = (SparseMoE(cfg, **fk, host_experts=host_experts, pin=pin) if cfg.is_moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, **fk))


class MTPModule(nn.Module):
    """The multi-token-prediction head shipped in Qwen3.5 checkpoints (``mtp.*``).

    ``h' = fc([pre_fc_norm_embedding(embed(t_next)) ; pre_fc_norm_hidden(h)])``, then
    ``mtp_num_hidden_layers`` full-attention decoder layers and ``norm``; the model's
    ``lm_head`` gives the draft logits. Kept here for the speculative backends."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, **fk)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, **fk)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, **fk)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", **fk)
                                     for _ in range(cfg.mtp_num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, **fk)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layers' input from the next token's embedding and the main model's hidden."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
        if dtype not in table:
            from hpc_cli.errors import ConfigError

            raise ConfigError(f"unknown model dtype {dtype!r}", hint=f"choose one of: {', '.join(table)}")
        return table[dtype]
    return dtype


class HybridModel(nn.Module):
    """``offload_experts``: the main layers' routed experts are created in host memory (pinned when
    ``device`` is CUDA) as the packed arrays :class:`hpc_cli.experts.tier.ExpertTier` adopts,
    everything else on ``device``; the MTP head's experts stay on ``device``. A model built so
    and used without a tier computes its routed experts on the host."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype | str | None = None, with_mtp: bool = False,
                 offload_experts: bool = False) -> None:
        super().__init__()
        device = torch.device(device)
        dtype = resolve_dtype(dtype, device)
        fk = dict(device=device, dtype=dtype)
        self.config = config
        self.device, self.dtype = device, dtype
        self.offload_experts = bool(offload_experts and config.is_moe)
        host = dict(host_experts=True, pin=device.type == "cuda") if self.offload_experts else {}
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(config.vocab_size, config.hidden_size, **fk)
        self.layers = nn.ModuleList([DecoderLayer(config, kind, **fk, **host) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **fk)
        #: rows per block of decode's and verify's row-wise ops (hpc_cli.model.columns); decode and
        #: verify agree bit for bit only under the same value, so set it before serving
        self.row_block: int | None = None
        #: prefill passes are padded to a multiple of this many tokens (see :meth:`prefill`): 64 on
        #: CUDA for dense models, 1 (no padding) on CPU and for MoE models, whose routing must see
        #: real tokens only
        self.prefill_pad = 64 if device.type == "cuda" and not config.is_moe else 1
        #: replay decode and verify passes as CUDA graphs where they apply ([engine] cuda_graphs)
        self.cuda_graphs = True
        #: those graphs (hpc_cli.model.graphs), made at the first pass that uses them
        self._graphs = None
        #: the prefill passes' graphs (hpc_cli.model.prefill_graphs), likewise
        self._prefill_graphs = None
        self._wanted_memo: tuple[weakref.ref, tuple, bool] | None = None  # (pool, switches, answer)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, **fk)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp: MTPModule | None = MTPModule(config, **fk) if with_mtp and config.mtp_num_hidden_layers else None
        self.rotary = Rotary(config.rotary_dim, config.rope_theta, device=device)
        self.tokenizer = None  # set by from_name_or_path
        #: a multimodal checkpoint's vision tower, its config and its image preprocessing (set by
        #: the loader, hpc_cli.model.vision.attach_vision); None for a text-only model
        self.vision: "VisionTower | None" = None
        self.multimodal: "MultimodalConfig | None" = None
        self.image_processor: "ImageProcessorConfig | None" = None
        # model layer -> index among attention layers (KV pools) / among GDN layers (state slots)
        self.kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self.state_index = {layer: i for i, layer in enumerate(config.gdn_layers)}

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_name_or_path(cls, name_or_path: str, dtype: torch.dtype | str | None = None,
                          device: torch.device | str = "cpu", progress: bool = True,
                          offload_experts: bool = False, quantized_weights: str = "auto",
                          merge: bool = True) -> "HybridModel":
        """``builtin:tiny`` (trained, shipped in the package: loaded as a HF checkpoint directory),
        ``builtin:random[@layers]`` / ``builtin:qwen3.5-27b-shape[@layers]`` /
        ``builtin:qwen3.5-35b-a3b-shape[@layers]`` (seeded weights) or a HF checkpoint directory. ``offload_experts``: routed experts are
        created and loaded straight into host memory (see the class), for the expert tier.
        ``quantized_weights``: ``auto``, ``held`` or ``dequantized`` (a quantized checkpoint's
        Linear weights on CUDA, :class:`hpc_cli.model.quant_linear.WeightsChoice`). ``merge``: the
        projections that read one input multiplied as one weight (:mod:`hpc_cli.model.merged`)."""
        if str(name_or_path).startswith("builtin:"):
            from hpc_cli.model.builtin import build_builtin

            model = build_builtin(str(name_or_path), dtype=dtype, device=device, offload_experts=offload_experts,
                                  progress=progress)
        else:
            from hpc_cli.model.loader import load_checkpoint
            from hpc_cli.model.quant_linear import WeightsChoice

            model = load_checkpoint(name_or_path, dtype=dtype, device=device, progress=progress,
                                    offload_experts=offload_experts, weights=WeightsChoice(quantized_weights))
        if merge:
            from hpc_cli.model.merged import merge_projections

            merge_projections(model)
        return model

    def shape(self) -> "HybridShape":
        return self.config.shape(state_dtype_bytes=torch.finfo(self.dtype).bits // 8)

    def new_kv_storage(self, profile: "KVProfile | str", num_pages: int, name: str = "main") -> "PagedKVStorage":
        """A page pool for this model's attention layers in ``profile``'s format."""
        from hpc_cli.memory.kv_pool import PagedKVStorage

        if isinstance(profile, str):
            from hpc_cli.plugins import kv_profile

            profile = kv_profile(profile)
        c = self.config
        return PagedKVStorage(profile, len(c.attention_layers), c.num_key_value_heads, c.head_dim, num_pages,
                              device=self.device, name=name)

    def new_state_slots(self, num_slots: int, extra_parts=None) -> "StateSlots":
        """State slots for this model's GDN layers (conv window in the model dtype, recurrent fp32);
        ``extra_parts``: a speculative backend's image parts (name -> (shape, dtype))."""
        from hpc_cli.memory.state_pool import StateSlots

        c = self.config
        return StateSlots(len(c.gdn_layers), c.conv_dim, c.linear_conv_kernel_dim - 1, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim, c.hidden_size, num_slots,
                          dtype=self.dtype, device=self.device, extra_parts=extra_parts)

    # -- execution ---------------------------------------------------------------------------
    def _tokens(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if not torch.is_tensor(tokens):
            tokens = torch.tensor(list(tokens), dtype=torch.long)
        return tokens.to(device=self.device, dtype=torch.long).reshape(-1)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens.weight)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor | Sequence[int], start: int, block_table: Sequence[int],
                state_slot: int, kv: "PagedKVStorage", states: "StateSlots", *,
                layer_ready: Callable[[int], None] | None = None, all_logits: bool = False,
                all_hidden: bool = False, capture: Sequence[int] = (),
                media: "PrefillMedia | None" = None, taps: Sequence[TapImage] = ()) -> PrefillOut:
        """One lane's prefill pass of ``tokens`` at positions ``start ..``: K/V written into the
        lane's pages, the GDN states of ``state_slot`` advanced, the last position's logits.

        On CUDA the pass is padded at its end to a multiple of :attr:`prefill_pad` tokens (padded
        rows leave every state untouched: no K/V write, zero decay and zero write strength in the
        GDN, their outputs dropped), so the kernels meet only ``chunk / prefill_pad`` lengths and
        the warm-up compiles all of them. Attention reads the pages in place (the paged prefill
        kernel) where the pool allows, else gathers the span (:func:`prefill_attention`).
        ``media`` (a Vision prompt's pass): the tokens' mRoPE positions and the image embeddings
        that replace their placeholder rows. ``taps``: state images to take inside the pass
        (:mod:`hpc_cli.model.gdn_taps`; positions ``start < p < start + T``, sorted, each written
        into its own state slot, not ``state_slot``; as many as
        :func:`hpc_cli.model.gdn_taps.tap_capacity` allows), returned in ``PrefillOut.taps``."""
        assert start >= 0, f"prefill start must be >= 0, got {start}"
        if media is None and not all_logits:
            graphs = self.prefill_graphs(kv)
            if graphs is not None and len(taps) <= graphs.tap_slots:
                if layer_ready is not None:  # a graph runs every layer at once: the restore lands first
                    for i in range(len(self.layers)):
                        layer_ready(i)
                out = graphs.run(tokens if torch.is_tensor(tokens) else list(tokens), start, block_table,
                                 state_slot, kv, states, taps=[(t.position - start, t.slot) for t in taps],
                                 all_hidden=all_hidden, capture=tuple(capture))
                return PrefillOut(logits=out.logits, hidden_last=out.hidden_last, hidden=out.hidden,
                                  features=out.features, taps=list(taps))
        tokens = self._tokens(tokens)
        t = tokens.shape[0]
        assert t >= 1, "prefill needs at least one token"
        end = start + t
        page = kv.page_tokens
        n_pages = (end + page - 1) // page
        assert len(block_table) >= n_pages, \
            f"block table has {len(block_table)} pages, positions [0, {end}) need {n_pages}"
        dev = self.device
        pad = (-t) % max(1, int(self.prefill_pad))
        if pad:
            tokens = F.pad(tokens, (0, pad))
        pages = torch.tensor(list(block_table[:n_pages]), dtype=torch.long, device=dev)
        positions = torch.arange(start, end + pad, device=dev)
        real = positions[:t]
        write_slots = pages.index_select(0, real // page) * page + real % page
        if media is None:
            cos, sin = self.rotary.cos_sin(positions, self.dtype)
        else:
            cos, sin = media.cos_sin(self.rotary, self.multimodal.mrope_section, pad, self.dtype)
        paged = kv.paged_attention_supported(self.config.num_attention_heads)
        x = self._embed(tokens) if media is None else media.apply(self._embed(tokens))
        feats = []
        offsets = [tap.position - start for tap in taps]
        assert all(0 < o < t for o in offsets), f"taps {offsets} (offsets) not inside the pass of {t}"
        assert state_slot not in {tap.slot for tap in taps}, "a tap's image goes to a slot of its own"
        for i, layer in enumerate(self.layers):
            if layer_ready is not None:
                layer_ready(i)
            h = layer.input_layernorm(x)
            if layer.kind == "linear_attention":
                g = self.state_index[i]
                conv, rec = states.conv[g], states.recurrent[g]
                if offsets:
                    out, new_conv, new_rec, tapped = layer.linear_attn.prefill_tapped(
                        h, conv[state_slot], rec[state_slot], offsets, valid=t)
                    for tap, (c, r) in zip(taps, tapped):
                        conv[tap.slot].copy_(c)
                        rec[tap.slot].copy_(r)
                else:
                    out, new_conv, new_rec = layer.linear_attn.prefill(h, conv[state_slot], rec[state_slot], valid=t)
                conv[state_slot].copy_(new_conv)
                rec[state_slot].copy_(new_rec)
            else:
                a = self.kv_index[i]
                attn = layer.self_attn
                q, gate, k, v = attn.qkv(h, cos, sin)
                kv.write(a, write_slots, k[:t], v[:t])
                if paged:
                    o = kv.prefill_attention(a, q, pages, start, attn.scale, valid=t)
                else:
                    o = prefill_attention(attn, q[:t], kv, a, pages, start)
                    if pad:
                        o = F.pad(o, (0, 0, 0, 0, 0, pad))
                out = attn.finish(o, gate)
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if capture and i in capture:
                feats.append(x[:t])
        if offsets:
            tap_hidden = self.norm(x[torch.tensor([o - 1 for o in offsets], device=dev)])
            for tap, hid in zip(taps, tap_hidden):
                states.hidden[tap.slot].copy_(hid)
        x = x[:t] if (all_logits or all_hidden) else x[t - 1:t]
        x = self.norm(x)
        states.hidden[state_slot].copy_(x[-1])
        logits = self.lm_head(x if all_logits else x[-1:])
        return PrefillOut(logits=logits if all_logits else logits[0], hidden_last=x[-1],
                          hidden=x if all_hidden else None,
                          features=torch.cat(feats, dim=-1) if feats else None, taps=list(taps))

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor | Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]], state_slots: Sequence[int],
               kv: "PagedKVStorage", states: "StateSlots",
               rope_offsets: Sequence[int] | None = None,
               prepared: "PreparedDecode | None" = None) -> torch.Tensor:
        """One token for each of ``B`` lanes: logits ``[B, vocab]``. The column pass with one
        column (:mod:`hpc_cli.model.columns`), so the speculative verify pass, which runs the
        same code with ``k + 1`` columns, computes every column bit-identically to this.
        ``rope_offsets[b]``: lane ``b``'s rotary position is its position plus this (the mRoPE
        delta of a Vision prompt; None: all 0). ``prepared``: this step's index built ahead
        (:meth:`prepare_decode`), used when it was built for exactly these inputs."""
        from hpc_cli.model.columns import columns_pass

        if prepared is not None and not torch.is_tensor(tokens) and prepared.matches(
                positions, block_tables, state_slots, rope_offsets):
            logits = self._graphs.decode_prepared(prepared, tokens, kv, states) if self._graphs else None
            if logits is not None:
                return logits

        if not torch.is_tensor(tokens):
            tokens = torch.tensor(list(tokens), dtype=torch.long)
        tokens = tokens.reshape(-1).long()
        bsz = tokens.shape[0]
        assert len(positions) == len(block_tables) == len(state_slots) == bsz, \
            "decode needs one position, block table and state slot per token"
        assert len(set(state_slots)) == bsz, f"decode lanes share a state slot: {list(state_slots)}"
        graphs = self.column_graphs(kv)
        if graphs is not None:
            return graphs.decode(tokens.cpu(), list(positions), block_tables, list(state_slots), kv, states,
                                 rope_offsets=rope_offsets)
        out = columns_pass(self, tokens.view(bsz, 1), list(positions), block_tables, list(state_slots), kv, states,
                           keep_all=False, rope_offsets=rope_offsets)
        return out.logits[:, 0]

    def prepare_decode(self, positions: Sequence[int], block_tables: Sequence[Sequence[int]],
                       state_slots: Sequence[int], kv: "PagedKVStorage", states: "StateSlots",
                       rope_offsets: Sequence[int] | None = None) -> "PreparedDecode | None":
        """The host's part of a later decode step (its packed index, the graph it replays), built
        now so that the step itself only fills in its tokens: pass it to :meth:`decode` as
        ``prepared``. None where decode steps do not replay graphs, or before the step's graph is
        captured."""
        graphs = self.column_graphs(kv)
        if graphs is None:
            return None
        return graphs.prepare_decode(positions, block_tables, state_slots, kv, states, rope_offsets)

    def column_graphs(self, kv: "PagedKVStorage"):
        """The CUDA graphs of this model's column passes over ``kv`` (:mod:`hpc_cli.model.graphs`),
        or None where graphs are not used (CPU, MoE, a pool the paged kernel cannot read,
        ``HPC_CUDA_GRAPHS=0``, a failed capture)."""
        if self.device.type != "cuda":
            return None
        from hpc_cli.model.graphs import ColumnGraphs

        if not self._graphs_wanted(kv):
            return None
        if self._graphs is None:
            self._graphs = ColumnGraphs(self)
        return None if self._graphs.disabled else self._graphs

    def _graphs_wanted(self, kv: "PagedKVStorage") -> bool:
        """:meth:`ColumnGraphs.wanted` for ``kv``, worked out once per pool and switch setting (each
        decode step and verify pass asks; the answer walks the layers and the pool's formats)."""
        from hpc_cli.model.graphs import ColumnGraphs

        switches = (self.cuda_graphs, os.environ.get("HPC_CUDA_GRAPHS"))
        memo = self._wanted_memo
        if memo is not None and memo[0]() is kv and memo[1] == switches:
            return memo[2]
        wanted = ColumnGraphs.wanted(self, kv)
        self._wanted_memo = (weakref.ref(kv), switches, wanted)
        return wanted

    def prefill_graphs(self, kv: "PagedKVStorage"):
        """The CUDA graphs of this model's plain prefill passes over ``kv``
        (:mod:`hpc_cli.model.prefill_graphs`), or None where the column graphs are not used either,
        or a capture failed."""
        if self.device.type != "cuda" or int(self.prefill_pad) <= 1:
            return None
        from hpc_cli.model.prefill_graphs import PrefillGraphs

        if not self._graphs_wanted(kv):
            return None
        if self._prefill_graphs is None:
            self._prefill_graphs = PrefillGraphs(self)
        return None if self._prefill_graphs.disabled else self._prefill_graphs

    # -- conveniences for tests and tools ----------------------------------------------------
    @torch.inference_mode()
    def forward_tokens(self, tokens: torch.Tensor | Sequence[int], kv_profile: "KVProfile | str" = "bf16",
                       media: "PrefillMedia | None" = None) -> torch.Tensor:
        """All-position logits ``[T, vocab]`` of one sequence from scratch, on private scratch pools
        (``media``: a Vision prompt's positions and image embeddings)."""
        tokens = self._tokens(tokens)
        n_pages = max(1, -(-tokens.shape[0] // PAGE_TOKENS))
        kv = self.new_kv_storage(kv_profile, n_pages, name="scratch")
        states = self.new_state_slots(1)
        return self.prefill(tokens, 0, list(range(n_pages)), 0, kv, states, all_logits=True, media=media).logits
