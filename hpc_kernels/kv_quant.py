"""Dispatch for KV quantisation: the Triton kernels on CUDA (when Triton imports and the shape
suits them), the torch reference (``kv_quant_ref``) everywhere else. Both give the same bytes.

``HPC_KV_KERNELS=torch`` forces the reference (for debugging a kernel against its twin).
"""

from __future__ import annotations

import functools
import os

import torch

from . import kv_quant_ref as ref
from .kv_quant_ref import SideFormat

__all__ = ["SideFormat", "quantize_into", "dequantize_slots", "dequantize_pages", "use_triton", "page_slots"]


@functools.cache
def _triton_module():
    try:
        from . import kv_quant_triton
    except Exception:  # no Triton, or a Triton that cannot build here
        return None
    return kv_quant_triton


def use_triton(fmt: SideFormat, device: torch.device, head_dim: int) -> bool:
    if device.type != "cuda" or os.environ.get("HPC_KV_KERNELS", "").lower() == "torch":
        return False
    mod = _triton_module()
    return mod is not None and mod.supports(fmt, head_dim)


def _gs_float(global_scale) -> float:
    if global_scale is None:
        return 1.0
    return float(global_scale)  # a CPU tensor or a float: no device sync


def page_slots(page_ids: torch.Tensor, n_tokens: int, page_tokens: int) -> torch.Tensor:
    """Slot of each of the first ``n_tokens`` tokens of the pages ``page_ids`` (in order)."""
    offs = torch.arange(page_tokens, device=page_ids.device, dtype=torch.long)
    return (page_ids.long()[:, None] * page_tokens + offs[None, :]).reshape(-1)[:n_tokens]


def quantize_into(fmt: SideFormat, x: torch.Tensor, slots: torch.Tensor, planes, global_scale=None,
                  counter: torch.Tensor | None = None) -> None:
    """Quantise ``x`` ``[N, H, D]`` into this side's ``planes`` (``uint8 [..., H, bytes]``) at
    ``slots`` (negative = skip); add the number of non-finite inputs to ``counter``."""
    n, h, d = x.shape
    assert slots.shape == (n,), f"slots {tuple(slots.shape)} do not match {n} tokens"
    flats = [p.view(-1, h, p.shape[-1]) for p in planes]
    if use_triton(fmt, x.device, d):
        mod = _triton_module()
        mod.quantize_into(fmt, x, slots.to(device=x.device, dtype=torch.long), flats, _gs_float(global_scale), counter)
        return
    slots = slots.to(device=flats[0].device, dtype=torch.long)
    coded = ref.quantize(fmt, x, global_scale)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, coded = slots[keep], [c[keep] for c in coded]
    for flat, c in zip(flats, coded):
        # one row per slot: index_copy_ (several times cheaper than index_put_ on CPU)
        flat.index_copy_(0, slots, c.to(flat.device))
    if counter is not None:
        counter.add_(ref.count_nonfinite(x).to(counter.device, counter.dtype))


def dequantize_slots(fmt: SideFormat, planes, slots: torch.Tensor, head_dim: int, dtype: torch.dtype,
                     global_scale=None) -> torch.Tensor:
    """The rows at ``slots`` of this side's ``planes``, dequantised: ``[len(slots), H, head_dim]``."""
    h = planes[0].shape[-2]
    flats = [p.view(-1, h, p.shape[-1]) for p in planes]
    if use_triton(fmt, flats[0].device, head_dim):
        mod = _triton_module()
        return mod.dequantize_slots(fmt, flats, slots.to(device=flats[0].device, dtype=torch.long), head_dim,
                                    dtype, _gs_float(global_scale))
    slots = slots.to(device=flats[0].device, dtype=torch.long)
    # index_select: the same rows as f[slots], several times cheaper on CPU
    return ref.dequantize(fmt, [f.index_select(0, slots) for f in flats], dtype, global_scale)


def dequantize_pages(fmt: SideFormat, planes, page_ids: torch.Tensor, n_tokens: int, page_tokens: int,
                     head_dim: int, dtype: torch.dtype, global_scale=None) -> torch.Tensor:
    """The first ``n_tokens`` tokens of the pages ``page_ids`` (in order), dequantised:
    ``[n_tokens, H, head_dim]``. The kernels read the page table directly (no slot list)."""
    h = planes[0].shape[-2]
    flats = [p.view(-1, h, p.shape[-1]) for p in planes]
    if use_triton(fmt, flats[0].device, head_dim):
        mod = _triton_module()
        return mod.dequantize_slots(fmt, flats, page_ids.to(device=flats[0].device, dtype=torch.long), head_dim,
                                    dtype, _gs_float(global_scale), page_tokens=page_tokens, n_tokens=n_tokens)
    slots = page_slots(page_ids.to(flats[0].device), n_tokens, page_tokens)
    return dequantize_slots(fmt, planes, slots, head_dim, dtype, global_scale)
