"""Qwen3.5's vision tower (HF ``model.visual``) and the multimodal part of a checkpoint's config.

An image arrives as patches (:mod:`hpc_cli.model.image_processor`): ``[N, C * tp * p * p]`` rows
in *merge-block order* (the ``m x m`` patches that become one language-model token are
consecutive), with its grid ``(t, h, w)`` in patches. The tower:

* **patch embedding**: the checkpoint's ``Conv3d`` with kernel = stride = ``(tp, p, p)`` is one
  linear map of each flattened patch (``patch_embed.proj``);
* **learned positions**: the square ``pos_embed`` table (``side x side``) resampled bilinearly
  (corners aligned) to the image's ``h x w`` grid and added;
* **2-D rotary**: per head, the first half of the rotary frequencies turns with the patch's row,
  the second half with its column (``rope_theta``, whole head rotated, no partial rotary);
* ``depth`` **blocks**: pre-norm LayerNorm, full bidirectional attention within each frame of
  each image (no window attention in Qwen3.5), pre-norm MLP with tanh-GELU;
* the **merger**: LayerNorm per patch, then each ``m x m`` group concatenated and mapped by two
  linears (exact GELU between) to the language model's hidden size.

So an image of ``t x h x w`` patches becomes ``t * h * w / m^2`` language-model embeddings, which
replace the embeddings of its ``<|image_pad|>`` placeholder tokens (:class:`PrefillMedia`).
Parameter names follow HF's (``blocks.0.attn.qkv.weight``), under ``model.visual.`` in a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.errors import ModelError
from hpc_cli.model.layers import Linear, Rotary, param
from hpc_cli.model.mrope import mrope_cos_sin

if TYPE_CHECKING:
    from hpc_cli.model.model import HybridModel

#: the modality code of an image in media keys (hpc_cli.cache.keys.MediaItem)
IMAGE = 1


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The tower's shape (HF ``vision_config``)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: ``C * tp * p * p``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table."""
        return int(round(self.num_position_embeddings ** 0.5))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "VisionConfig":
        def need(key: str) -> Any:
            if key not in raw:
                raise ModelError(f"{name}: vision_config lacks {key!r}", hint="is this a complete Qwen3.5 config.json?")
            return raw[key]

        rope = raw.get("rope_parameters") or {}
        cfg = cls(depth=int(raw.get("depth", raw.get("num_hidden_layers", 0)) or need("depth")),
                  hidden_size=int(need("hidden_size")),
                  num_heads=int(raw.get("num_heads", raw.get("num_attention_heads", 0)) or need("num_heads")),
                  intermediate_size=int(need("intermediate_size")), out_hidden_size=int(need("out_hidden_size")),
                  num_position_embeddings=int(need("num_position_embeddings")),
                  patch_size=_one(raw.get("patch_size", 16), "patch_size", name),
                  temporal_patch_size=_one(raw.get("temporal_patch_size", 2), "temporal_patch_size", name),
                  spatial_merge_size=int(raw.get("spatial_merge_size", 2)), in_channels=int(raw.get("in_channels", 3)),
                  hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
                  rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))))
        cfg.validate(name)
        return cfg

    def validate(self, name: str = "checkpoint") -> None:
        where = f"{name}: vision_config"
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ModelError(f"{where}: hidden_size {self.hidden_size} over {self.num_heads} heads needs a head size "
                             "divisible by 4", hint="fix config.json")
        if self.grid_side ** 2 != self.num_position_embeddings:
            raise ModelError(f"{where}: num_position_embeddings {self.num_position_embeddings} is not a square",
                             hint="fix config.json")
        if self.hidden_act not in _ACTS:
            raise ModelError(f"{where}: hidden_act {self.hidden_act!r} is not supported",
                             hint=f"Qwen3.5's vision tower uses one of {', '.join(_ACTS)}")


def _one(v: Any, key: str, name: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ModelError(f"{name}: vision_config {key} {v} is not square", hint="hpc-cli takes square patches")
        v = v[0]
    return int(v)


_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "silu": F.silu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass(frozen=True, slots=True)
class MultimodalConfig:
    """What a multimodal checkpoint adds to its text stack: the tower, the placeholder token ids
    and the language model's mRoPE sections (how the rotary frequencies split over t, h, w)."""

    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "MultimodalConfig | None":
        """None for a text-only config (no ``vision_config``)."""
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            return None
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10)))
        if len(section) != 3:
            raise ModelError(f"{name}: mrope_section {list(section)} needs three entries (t, h, w)",
                             hint="fix config.json")
        ids = {}
        for key, default in (("image_token_id", 248056), ("video_token_id", 248057),
                             ("vision_start_token_id", 248053), ("vision_end_token_id", 248054)):
            ids[key] = int(raw.get(key, default))
        return cls(VisionConfig.from_hf_dict(vc, name), mrope_section=section, **ids)  # type: ignore[arg-type]


@dataclass(slots=True)
class PrefillMedia:
    """What a prefill pass over a Vision prompt needs beyond its tokens: the mRoPE positions of
    its tokens ``[3, T]`` (t, h, w) and the image embeddings that replace placeholder rows
    (``(row in the pass, [L, hidden])``, rows ``row .. row + L - 1``)."""

    positions: torch.Tensor
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def cos_sin(self, rotary: "Rotary", section: Sequence[int], pad: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's rotary ``cos, sin``; ``pad`` padded rows continue the last position."""
        pos = self.positions.to(rotary.inv_freq.device)
        if pad:
            pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
        return mrope_cos_sin(rotary, pos, section, dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T', hidden]`` (the pass's token embeddings) with the image rows put in."""
        if not self.embeds:
            return x
        x = x.clone()
        for row, e in self.embeds:
            x[row:row + e.shape[0]] = e.to(dtype=x.dtype, device=x.device)
        return x


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with HF's parameter names, created uninitialised (the loader fills it)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = param(dim, device=device, dtype=dtype)
        self.bias = param(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = param(cfg.hidden_size, cfg.in_channels, tp, p, p, **fk)
        self.proj.bias = param(cfg.hidden_size, **fk)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, **fk)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True, **fk)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # [N, H, d] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = []
        at = 0
        for length in segments:  # full attention inside each frame of each image
            sl = slice(at, at + length)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                               scale=self.head_dim ** -0.5)
            out.append(o.transpose(0, 1).reshape(length, -1))
            at += length
        return self.proj(torch.cat(out))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head in fp32 (``rotate_half`` form); cos/sin ``[N, d]``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, **fk)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, **fk)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.norm1 = LayerNorm(cfg.hidden_size, **fk)
        self.norm2 = LayerNorm(cfg.hidden_size, **fk)
        self.attn = VisionAttention(cfg, **fk)
        self.mlp = VisionMLP(cfg, **fk)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        merged = cfg.hidden_size * cfg.merge_unit
        self.norm = LayerNorm(cfg.hidden_size, **fk)
        self.linear_fc1 = Linear(merged, merged, bias=True, **fk)
        self.linear_fc2 = Linear(merged, cfg.out_hidden_size, bias=True, **fk)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, **fk)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = param(cfg.num_position_embeddings, cfg.hidden_size, **fk)
        self.blocks = nn.ModuleList([VisionBlock(cfg, **fk) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, **fk)
        quarter = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device)
                                                  / quarter))

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def tokens_of(self, grid: Sequence[int]) -> int:
        """Language-model tokens an image of ``grid`` (t, h, w) patches becomes."""
        t, h, w = grid
        return t * h * w // self.config.merge_unit

    def check_grid(self, grid: Sequence[int], n_patches: int) -> None:
        t, h, w = (int(g) for g in grid)
        m = self.config.spatial_merge_size
        assert t >= 1 and h % m == 0 and w % m == 0 and h and w, f"grid {tuple(grid)} is not a multiple of the merge size {m}"
        assert n_patches == t * h * w, f"{n_patches} patches for grid {tuple(grid)}"

    # -- positions ------------------------------------------------------------------------------
    def _merge_order(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of each patch in merge-block order."""
        m = self.config.spatial_merge_size
        dev = self.inv_freq.device
        rows = torch.arange(h, device=dev)[:, None].expand(h, w)
        cols = torch.arange(w, device=dev)[None, :].expand(h, w)

        def order(g: torch.Tensor) -> torch.Tensor:
            return g.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)

        return order(rows), order(cols)

    def _learned_positions(self, h: int, w: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The position table resampled bilinearly (corners aligned) at each patch: ``[h*w, D]``."""
        side = self.config.grid_side
        table = self.pos_embed.weight.view(side, side, -1)

        def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = index.float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long()
            return lo.clamp(0, side - 1), (lo + 1).clamp(0, side - 1), frac

        r0, r1, fr = taps(rows, h)
        c0, c1, fc = taps(cols, w)
        out = 0
        for ri, wr in ((r0, 1 - fr), (r1, fr)):
            for ci, wc in ((c0, 1 - fc), (c1, fc)):
                out = out + table[ri, ci] * (wr * wc)[:, None].to(table.dtype)
        return out

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.cat([rows.float()[:, None] * self.inv_freq, cols.float()[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    # -- the pass -------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Images' patches ``[sum N_i, patch_dim]`` (each image's rows in merge-block order) ->
        one ``[N_i / m^2, out_hidden]`` tensor of language-model embeddings per image."""
        dev = self.pos_embed.weight.device
        patches = patches.to(device=dev)
        pos, cos, sin, segments, counts = [], [], [], [], []
        at = 0
        for grid in grids:
            t, h, w = (int(g) for g in grid)
            self.check_grid(grid, t * h * w)
            rows, cols = self._merge_order(h, w)
            learned = self._learned_positions(h, w, rows, cols)
            c, s = self._rotary(rows, cols)
            pos.append(learned.repeat(t, 1))
            cos.append(c.repeat(t, 1))
            sin.append(s.repeat(t, 1))
            segments += [h * w] * t
            counts.append(t * h * w)
            at += t * h * w
        assert at == patches.shape[0], f"{patches.shape[0]} patch rows for grids totalling {at}"
        x = self.patch_embed(patches)
        x = x + torch.cat(pos).to(x.dtype)
        cos_t, sin_t = torch.cat(cos), torch.cat(sin)
        for blk in self.blocks:
            x = blk(x, cos_t, sin_t, segments)
        merged = self.merger(x)
        return list(torch.split(merged, [c // self.config.merge_unit for c in counts]))


def vision_name(hf_name: str) -> str | None:
    """Map a checkpoint tensor name to the tower's parameter name (None: not a vision tensor)."""
    for prefix in ("model.visual.", "visual.", "model.vision_tower.", "vision_tower."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    return None


def attach_vision(model: "HybridModel", raw_config: dict[str, Any], directory: str | Path,
                  tensor_names: Sequence[str]) -> bool:
    """Give ``model`` (a HybridModel) the vision tower of a multimodal checkpoint, created
    uninitialised for the loader to fill, with its config and image preprocessing. Only when the
    config has a ``vision_config`` and the checkpoint holds vision tensors: a checkpoint whose
    vision weights were stripped stays a text-only model. Returns whether it attached one."""
    from hpc_cli.model.image_processor import ImageProcessorConfig

    name = Path(directory).name or str(directory)
    mm = MultimodalConfig.from_hf_dict(raw_config, name)
    if mm is None or not any(vision_name(t) is not None for t in tensor_names):
        return False
    tower = VisionTower(mm.vision, device=model.device, dtype=model.dtype)
    if mm.vision.out_hidden_size != model.config.hidden_size:
        raise ModelError(f"{name}: the vision tower's out_hidden_size {mm.vision.out_hidden_size} differs from the "
                         f"language model's hidden_size {model.config.hidden_size}", hint="fix config.json")
    model.vision = tower
    model.multimodal = mm
    model.image_processor = ImageProcessorConfig.from_dir(directory, mm.vision)
    return True
