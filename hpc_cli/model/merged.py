"""Merged projections: the Linear layers that read one input, multiplied as one weight.

A layer's input feeds several products: the attention's q, k and v, the Gated DeltaNet's four
input projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), an MLP's gate
and up. Each is a kernel that reads the input and streams its own weight; at decode sizes the
small ones (attention's k and v, 1,024 outputs at the 27B widths; the GDN gates, 48) cost a
launch and a wave of programs each for little work. Merged, the parts' weights are rows of one
``[sum(out), in]`` tensor read by one product whose output is split back into the parts'.

Each part keeps its name and its weight: after :func:`merge` a part's ``weight`` (or its held
quantized weight's codes and scales) is a view of its rows in the merged tensor, so the model's
parameters, ``state_dict`` and footprint are what they were and no byte is held twice. A
:class:`MergedProjection` is not a submodule (it is not in ``state_dict``); it multiplies apart
while autograd records a part's gradient (training) and where a part's storage no longer is the
merged tensor's (``module.to(...)`` gives the parts new tensors), so it is never stale.

Parts merge in runs of the same kind: plain weights of one dtype and device (with biases all or
none); FP8 weights held as stored with the same scale block and every part but the last a whole
number of scale rows; NVFP4 weights with the same group and global factor. With an FP8
checkpoint the GDN's ``in_proj_qkv`` and ``in_proj_z`` (held FP8) merge into one product and its
``in_proj_b`` and ``in_proj_a`` (kept in the model dtype) into another.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hpc_cli.model.layers import Linear
from hpc_cli.model.quant_linear import FP8Weight, NVFP4Weight, QuantizedWeight
from hpc_cli.model.quant_weights import StoredFP8, StoredNVFP4


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive parts multiplied as one product (``product``), or one part alone (``None``)."""

    parts: tuple[Linear, ...]
    product: Linear | None
    sizes: tuple[int, ...]
    pointers: tuple[int, ...]  # each part's weight storage as merged, to tell when it moved
    #: a plain product of few outputs on CUDA: ``narrow_linear``, and the most rows it takes
    narrow: tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int] | None = None


def _codes(q: QuantizedWeight) -> str:
    """The name of a held weight's codes (its rows, one per output)."""
    return "weight" if isinstance(q, FP8Weight) else "packed"


def _storage(part: Linear) -> torch.Tensor:
    """The tensor whose rows are ``part``'s weight: its codes when held quantized."""
    return part.weight if part.quant is None else getattr(part.quant, _codes(part.quant))


def _kind(part: Linear) -> tuple:
    """Parts of equal kind merge: the same storage, dtype, device, input width and bias use."""
    q = part.quant
    bias = part.bias is not None
    if q is None:
        w = part.weight
        return ("plain", w.dtype, w.device, part.in_features, bias)
    if isinstance(q, FP8Weight):
        return ("fp8", q.block, q.weight.device, part.in_features, bias)
    if isinstance(q, NVFP4Weight):
        return ("nvfp4", q.group, float(q.factor), q.packed.device, part.in_features, bias)
    return ("other", id(part))  # an unknown held format: never merged


def _aligned(parts: Sequence[Linear]) -> bool:
    """Whether the parts' rows can be stacked: FP8 block scales need every part but the last to
    end on a scale row."""
    q = parts[0].quant
    if isinstance(q, FP8Weight):
        return all(p.out_features % q.block[0] == 0 for p in parts[:-1])
    return True


def _runs(parts: Sequence[Linear]) -> list[list[Linear]]:
    """The parts in runs of consecutive parts that merge."""
    runs: list[list[Linear]] = []
    last = None
    for p in parts:
        kind = _kind(p)
        if kind == last and kind[0] != "other" and _aligned(runs[-1] + [p]):
            runs[-1].append(p)
        else:
            runs.append([p])
        last = kind
    return runs


def _merged_quant(parts: Sequence[Linear]) -> QuantizedWeight:
    """One held weight over the parts' rows; each part's codes and scales become views of it."""
    qs = [p.quant for p in parts]
    first = qs[0]
    codes = _codes(first)
    if isinstance(first, FP8Weight):
        merged: QuantizedWeight = FP8Weight(StoredFP8(torch.cat([q.weight for q in qs]),
                                                      torch.cat([q.scale for q in qs]), first.block),
                                            first.weight.device)
    else:
        assert isinstance(first, NVFP4Weight), f"no merged form of {type(first).__name__}"
        merged = NVFP4Weight(StoredNVFP4(torch.cat([q.packed for q in qs]), torch.cat([q.scale for q in qs]),
                                         first.factor, first.group), first.packed.device)
    row, srow = 0, 0
    for q in qs:
        n, ns = getattr(q, codes).shape[0], q.scale.shape[0]
        setattr(q, codes, getattr(merged, codes)[row:row + n])
        q.scale = merged.scale[srow:srow + ns]
        row, srow = row + n, srow + ns
    return merged


def _stack(parts: Sequence[Linear], name: str) -> nn.Parameter:
    """The parts' parameter ``name`` (``weight`` or ``bias``) stacked by rows; each part's becomes
    a view of its rows (keeping whether it records a gradient)."""
    stacked = torch.cat([getattr(p, name).detach() for p in parts])
    row = 0
    for p in parts:
        n = p.out_features
        setattr(p, name, nn.Parameter(stacked[row:row + n], requires_grad=getattr(p, name).requires_grad))
        row += n
    return nn.Parameter(stacked, requires_grad=False)


def _narrow(product: Linear | None) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int] | None:
    """``(narrow_linear, the most rows it takes)`` where decode-sized rows multiply ``product``
    through it: a plain bf16/fp16 weight of at most ``NARROW_OUTPUTS`` rows on CUDA with no bias
    (a Gated DeltaNet's ``in_proj_b`` and ``in_proj_a`` beside projections held FP8, which cuBLAS
    runs as two kernels, a split-K product and its reduction); None otherwise."""
    if product is None or product.quant is not None or product.bias is not None or not product.weight.is_cuda:
        return None
    if importlib.util.find_spec("triton") is None or product.weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    from hpc_kernels.quant_gemm import DECODE_ROWS, NARROW_OUTPUTS, narrow_linear

    return (narrow_linear, DECODE_ROWS) if product.out_features <= NARROW_OUTPUTS else None


def _run(parts: Sequence[Linear]) -> _Run:
    """The run of ``parts``: merged into one product where there are several."""
    product = _merge_run(parts) if len(parts) > 1 else None
    return _Run(tuple(parts), product, tuple(p.out_features for p in parts),
                tuple(_storage(p).data_ptr() for p in parts), _narrow(product))


def _merge_run(parts: Sequence[Linear]) -> Linear:
    """A Linear (not a submodule of anything) whose weight stacks the parts' rows; each part's
    weight and bias become views of it."""
    first = parts[0]
    product = Linear(first.in_features, sum(p.out_features for p in parts), device="meta")
    if first.quant is not None:
        product.weight = None
        product.quant = _merged_quant(parts)
    else:
        product.weight = _stack(parts, "weight")
    if first.bias is not None:
        product.bias = _stack(parts, "bias")
    return product


class MergedProjection:
    """The parts (Linear layers that read one input) multiplied in as few products as their kinds
    allow; calling it returns each part's output, in the parts' order, as ``part(x)`` would."""

    def __init__(self, runs: Sequence[Sequence[Linear]]) -> None:
        """``runs``: the parts, in order, in runs of parts that merge (:func:`merge` finds them)."""
        self.parts = tuple(p for run in runs for p in run)
        assert len({p.in_features for p in self.parts}) == 1, "merged parts read one input"
        self.runs = tuple(_run(run) for run in runs)

    @property
    def products(self) -> int:
        """How many products a call runs."""
        return len(self.runs)

    def intact(self) -> bool:
        """Whether every part's weight still is its rows of the merged tensor."""
        return all(_storage(p).data_ptr() == ptr for r in self.runs for p, ptr in zip(r.parts, r.pointers))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.intact() or (torch.is_grad_enabled() and any(
                p.weight is not None and p.weight.requires_grad for p in self.parts)):
            return tuple(p(x) for p in self.parts)
        out: list[torch.Tensor] = []
        for r in self.runs:
            if r.product is None:
                out.append(r.parts[0](x))
            elif r.narrow is not None and x.dtype == r.product.weight.dtype and x.numel() <= r.narrow[1] * x.shape[-1]:
                out.extend(r.narrow[0](x, r.product.weight).split(r.sizes, dim=-1))
            else:
                out.extend(r.product(x).split(r.sizes, dim=-1))
        return tuple(out)


def merge(parts: Sequence[Linear]) -> MergedProjection | None:
    """A :class:`MergedProjection` of ``parts`` where at least two of them merge, else None (the
    parts stay as they are)."""
    if any(p.weight is None and p.quant is None for p in parts):
        return None
    if any(p.weight is not None and p.weight.device.type == "meta" for p in parts):
        return None
    runs = _runs(parts)
    if all(len(run) == 1 for run in runs):
        return None
    return MergedProjection(runs)


def is_merged(model: nn.Module) -> bool:
    """Whether any of ``model``'s layers multiplies merged projections."""
    return any(getattr(m, "merged", None) is not None for m in model.modules())


def merge_projections(model: nn.Module) -> int:
    """Merge the projections of every attention, Gated DeltaNet and MLP layer in ``model`` (set as
    their ``merged``); returns the number of products saved per pass."""
    from hpc_cli.model.attention import GatedAttention
    from hpc_cli.model.gdn import GatedDeltaNet
    from hpc_cli.model.layers import MLP

    saved = 0
    on_cuda = False
    for m in model.modules():
        if getattr(m, "merged", None) is not None:
            continue
        if isinstance(m, GatedAttention):
            parts = (m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, GatedDeltaNet):
            parts = (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
        elif isinstance(m, MLP):
            parts = (m.gate_proj, m.up_proj)
        else:
            continue
        merged = merge(parts)
        if merged is not None:
            m.merged = merged
            saved += len(parts) - merged.products
            on_cuda = on_cuda or _storage(parts[0]).is_cuda
    if on_cuda:
        # the parts' former tensors sit in the caching allocator's cache, where they would count
        # as used when the engine sizes its KV pool by the free memory: hand them back
        torch.cuda.empty_cache()
    return saved
