"""Device KV page storage in a KV profile's planes (spec §5.4, ARCHITECTURE.md §5).

Per attention layer and per plane, one ``uint8`` tensor ``[num_pages, 64, kv_heads, plane_bytes]``:
page ``p`` of a plane is contiguous, so a run of consecutive pages is one strided copy, and a
page's bytes are exactly what a host slab holds. ``write`` quantises new K/V through the profile
and scatters it by slot (``page * 64 + offset``); ``gather`` reads pages back dequantised.

Built-in profiles (those with ``side_format``) go through ``hpc_kernels.kv_quant``: Triton kernels
that quantise straight into the pages on CUDA, the torch reference on CPU, the same bytes either
way. Other profiles use their own ``quantize``/``dequantize`` and a scatter/gather here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hpc_cli.kv_profile import PAGE_TOKENS, KVProfile, RecordLayout


class PagedKVStorage:
    """The planes of every attention layer of one pool (main, or a backend's own pool)."""

    def __init__(self, profile: KVProfile, num_layers: int, kv_heads: int, head_dim: int,
                 num_pages: int, device: torch.device | str = "cpu", name: str = "main",
                 page_tokens: int = PAGE_TOKENS) -> None:
        assert num_pages >= 1, f"pool {name} needs at least one page, got {num_pages}"
        self.profile = profile
        self.layout: RecordLayout = profile.layout(head_dim)
        self.name = name
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.device = torch.device(device)
        self.planes: list[list[torch.Tensor]] = [
            [torch.zeros(num_pages, page_tokens, kv_heads, p.bytes_per_token_head,
                         dtype=torch.uint8, device=self.device) for p in self.layout.planes]
            for _ in range(num_layers)
        ]
        # Per-layer fp32 global scales for K and V (only used by profiles with uses_global_scale).
        self.global_scales = torch.tensor(
            [[profile.default_global_scale("k"), profile.default_global_scale("v")]] * num_layers,
            dtype=torch.float32)
        self._side_idx = {s: [i for i, p in enumerate(self.layout.planes) if p.side == s] for s in ("k", "v")}
        side_format = getattr(profile, "side_format", None)
        self._formats = ({s: side_format(s, head_dim) for s in ("k", "v")} if side_format is not None else None)
        # Non-finite inputs replaced on write (NaN -> 0, +-inf -> largest finite), per layer, K and V.
        self.nonfinite_counts = torch.zeros(num_layers, 2, dtype=torch.int32, device=self.device)

    # -- geometry ---------------------------------------------------------------------------
    @property
    def plane_page_bytes(self) -> list[int]:
        """Bytes of one page in each plane (the same for every layer)."""
        return [self.page_tokens * self.kv_heads * p.bytes_per_token_head for p in self.layout.planes]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and plane: what a host slab record holds."""
        return sum(self.plane_page_bytes) * self.num_layers

    def _gs(self, layer: int, side: str) -> torch.Tensor | None:
        if not self.profile.uses_global_scale:
            return None
        return self.global_scales[layer, 0 if side == "k" else 1]

    @property
    def skips_negative_slots(self) -> bool:
        """Whether :meth:`write` skips a token whose slot is negative (a built-in profile's pool),
        so that a write of fixed shape can leave tokens out on the device (a captured step)."""
        return self._formats is not None

    # -- data -------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise ``k``/``v`` ``[N, kv_heads, head_dim]`` and store token i at ``slots[i]``
        (a negative slot skips its token on the built-in profiles' path)."""
        planes = self.planes[layer]
        if self._formats is not None:
            from hpc_kernels import kv_quant

            for j, (side, x) in enumerate((("k", k), ("v", v))):
                kv_quant.quantize_into(self._formats[side], x, slots, [planes[i] for i in self._side_idx[side]],
                                       self._gs(layer, side), self.nonfinite_counts[layer, j])
            return
        for side, x in (("k", k), ("v", v)):
            coded = self.profile.quantize(x, side, self._gs(layer, side))
            for idx, data in zip(self._side_idx[side], coded):
                flat = planes[idx].view(-1, self.kv_heads, planes[idx].shape[-1])
                flat[slots] = data

    def gather(self, layer: int, page_ids: Sequence[int] | torch.Tensor, n_tokens: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n_tokens`` of the pages ``page_ids`` (in order), dequantised: K, V."""
        if not torch.is_tensor(page_ids):
            page_ids = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
        planes = self.planes[layer]
        if self._formats is not None:
            from hpc_kernels import kv_quant

            page_ids = page_ids.to(self.device)
            k, v = (kv_quant.dequantize_pages(self._formats[side], [planes[i] for i in self._side_idx[side]],
                                              page_ids, n_tokens, self.page_tokens, self.head_dim, dtype,
                                              self._gs(layer, side))
                    for side in ("k", "v"))
            return k, v
        out = []
        for side in ("k", "v"):
            parts = [planes[i][page_ids].view(-1, self.kv_heads, planes[i].shape[-1])[:n_tokens]
                     for i in self._side_idx[side]]
            out.append(self.profile.dequantize(parts, side, dtype, self._gs(layer, side)))
        return out[0], out[1]

    def bf16_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s K and V pages as BF16 ``[num_pages, page_tokens, kv_heads, head_dim]``
        views of the planes, where this pool stores plain BF16 (a backend's own pool); else None."""
        if self._formats is None or any(f.kind != "bf16" for f in self._formats.values()):
            return None
        planes = self.planes[layer]
        k, v = (planes[self._side_idx[s][0]].view(torch.bfloat16) for s in ("k", "v"))
        return k, v

    def paged_attention_supported(self, num_heads: int) -> bool:
        """Whether :meth:`decode_attention` can read this pool directly (CUDA, Triton, a built-in
        profile's formats, a head_dim the kernel takes)."""
        if self._formats is None or self.device.type != "cuda" or num_heads % self.kv_heads:
            return False
        from hpc_kernels import kv_quant

        if not kv_quant.use_triton(self._formats["k"], self.device, self.head_dim):
            return False
        from hpc_kernels import paged_attention

        return paged_attention.supports(self._formats["k"], self._formats["v"], self.head_dim, num_heads,
                                        self.kv_heads)

    def decode_attention(self, layer: int, q: torch.Tensor, tables: torch.Tensor, seqlens: torch.Tensor,
                         scale: float, rows: int | None = None) -> torch.Tensor:
        """One query per lane (``q`` ``[B, H, D]``) over the lane's pages (``tables`` ``[B, W]``,
        the first ``seqlens[b]`` tokens), read from the planes without a dequantised copy.
        ``rows``: the output's rows (>= B), those past ``B`` zero."""
        from hpc_kernels import paged_attention

        planes = self.planes[layer]
        gs = [float(self._gs(layer, s)) if self.profile.uses_global_scale else 1.0 for s in ("k", "v")]
        return paged_attention.paged_decode_attention(
            q, self._formats["k"], [planes[i] for i in self._side_idx["k"]], gs[0],
            self._formats["v"], [planes[i] for i in self._side_idx["v"]], gs[1], tables, seqlens, scale, rows)

    def prefill_attention(self, layer: int, q: torch.Tensor, table: torch.Tensor, start: int,
                          scale: float, valid: int | None = None, meta: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill pass's queries (``q`` ``[T, H, D]`` at positions ``start ..``) over one lane's
        pages (``table`` ``[P]``), causal, read from the planes in place (the pass's own K/V must
        be written first). Rows past ``valid`` (padding) read as the last valid row. ``meta``: start
        and valid as a device tensor (a CUDA graph's pass). Where :meth:`paged_attention_supported`."""
        from hpc_kernels import paged_prefill

        planes = self.planes[layer]
        gs = [float(self._gs(layer, s)) if self.profile.uses_global_scale else 1.0 for s in ("k", "v")]
        return paged_prefill.paged_prefill_attention(
            q, self._formats["k"], [planes[i] for i in self._side_idx["k"]], gs[0],
            self._formats["v"], [planes[i] for i in self._side_idx["v"]], gs[1], table, start, scale,
            valid=valid, meta=meta)

    def set_global_scale(self, layer: int, side: str, value: float) -> None:
        """Set a layer side's NVFP4 global scale; only before that layer holds data, since the
        stored codes are relative to it (it is part of the cache file's fingerprint)."""
        assert self.profile.uses_global_scale, f"profile {self.profile.name} has no global scale"
        assert value > 0 and value == value and value != float("inf"), f"bad global scale {value}"
        self.global_scales[layer, 0 if side == "k" else 1] = value

    def copy_page(self, src: int, dst: int, n_tokens: int | None = None) -> None:
        """Copy page ``src`` to ``dst`` in every layer and plane (the first ``n_tokens`` only)."""
        n = self.page_tokens if n_tokens is None else n_tokens
        for layer in self.planes:
            for plane in layer:
                plane[dst, :n].copy_(plane[src, :n])
