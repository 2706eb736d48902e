"""Small building blocks of the Qwen3.5 text stack: the two RMSNorm forms, rotary, the dense MLP.

Parameters are created uninitialised (``torch.empty``) on the target device and dtype; the
loader or the seeded initialiser fills them. Parameter names follow HF's, so a checkpoint
tensor ``layers.3.mlp.up_proj.weight`` lands in the parameter of that name.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hpc_kernels import rms_norm as norm_kernels
from hpc_kernels import swiglu
from hpc_kernels.launch import launchable
from hpc_kernels.split_sums import SplitSums

if TYPE_CHECKING:
    from hpc_cli.model.merged import MergedProjection
    from hpc_cli.model.quant_linear import QuantizedWeight


def env_switch(name: str) -> bool:
    """A model-level switch for a model used without an engine (``HPC_CUDA_GRAPHS``,
    ``HPC_FUSED_KERNELS``): on unless the variable says 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


#: the fused kernels on CUDA (:func:`fused`): ``[engine] fused_kernels`` sets it for the process's
#: engine; ``HPC_FUSED_KERNELS=0`` turns them off for a model used without one (the torch ops they
#: replace, for A/B runs)
FUSED_KERNELS = env_switch("HPC_FUSED_KERNELS")


def fused(x: torch.Tensor, *weights: "torch.Tensor | None") -> bool:
    """Whether the fused kernels take ``x`` (with ``weights``): on CUDA with Triton (or under
    Triton's interpreter, for tests), unless turned off, and never where autograd records the op
    (``x`` or a weight requires its gradient while gradients are on: a training forward, such as
    ``scripts/train_tiny.py``'s), since the kernels have no backward. Serving runs with gradients
    off and weights that require none, so it always takes them."""
    if not (FUSED_KERNELS and launchable(x)):
        return False
    return not (torch.is_grad_enabled()
                and (x.requires_grad or any(w is not None and w.requires_grad for w in weights)))

#: set while a model is built whose Linear weights the loader fills one by one (see
#: :func:`deferred_linear_weights`)
_DEFER_LINEAR = contextvars.ContextVar("defer_linear_weights", default=False)


@contextlib.contextmanager
def deferred_linear_weights() -> Iterator[None]:
    """Linear layers built inside create their ``weight`` on the ``meta`` device (no memory): the
    loader then gives each one its tensor, or a :class:`QuantizedWeight` kept as stored, so a
    quantized checkpoint never holds its Linear weights in the model dtype as well."""
    token = _DEFER_LINEAR.set(True)
    try:
        yield
    finally:
        _DEFER_LINEAR.reset(token)


def param(*shape: int, device=None, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


#: a float32 product of 2 to this many rows on the CPU runs as ``W @ x^T`` (:func:`linear`)
FEW_ROWS = 16
#: a one-row product with a weight of at least this many elements and at least 4x as many
#: outputs as inputs (an ``lm_head``, a wide projection) runs as two rows (:func:`linear`)
TALL_ELEMENTS = 1 << 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``. On the CPU in float32, a product of 2 to :data:`FEW_ROWS`
    rows (decode's and verify's row blocks, a drafter's block) is computed as ``(W @ x^T)^T``, the
    weight the long operand: MKL's ``x @ W^T`` for a few rows reads the weight at a fraction of the
    memory's speed on some CPUs (an AMD EPYC: 4 rows x 256 -> 6,144 cold 905 us against 275, 2 rows
    1,384 against 237; warm 1.2-1.6x). One row with a tall weight of at least
    :data:`TALL_ELEMENTS` (an ``lm_head``: a drafter's one-column block, an MTP step, a prompt's
    last row) runs the same way padded to two rows (256 -> 6,144 cold 793 us against 240, warm
    the same; 256 -> 16,480 1,959 and 1,043 us against 533 and 439); a short or wide weight's one
    row keeps the GEMV, which is faster there. A fixed shape always takes the same form, so decode
    and verify, whose row blocks have the same rows, keep their bit identity; longer runs (a
    prefill pass) keep ``F.linear``, as do bf16 and a bias."""
    if bias is not None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.numel() // max(1, k)
    tall = n >= 4 * k and weight.numel() >= TALL_ELEMENTS
    if not (1 < rows <= FEW_ROWS or (rows == 1 and tall)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if rows == 1:  # as two rows, the second zero
        x2 = torch.cat([x2, x2.new_zeros(1, k)])
    return torch.mm(weight, x2.t())[:, :rows].t().contiguous().view(*x.shape[:-1], n)


class Linear(nn.Module):
    """``y = x W^T`` with HF's ``weight`` name; no bias (Qwen3.5 has none), no init cost. With
    ``quant`` set (a quantized checkpoint on CUDA) the weight is held as stored and ``weight`` is
    None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        wdev = "meta" if _DEFER_LINEAR.get() else device
        self.weight = param(out_features, in_features, device=wdev, dtype=dtype)
        self.bias = param(out_features, device=device, dtype=dtype) if bias else None
        self.quant: "QuantizedWeight | None" = None

    def hold_quantized(self, weight: "QuantizedWeight") -> None:
        """Keep the weight as stored: ``weight`` becomes None, ``forward`` multiplies in place."""
        assert (weight.out_features, weight.in_features) == (self.out_features, self.in_features), (
            f"quantized weight {weight.out_features}x{weight.in_features} for a "
            f"{self.out_features}x{self.in_features} Linear")
        self.weight = None
        self.quant = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias)

    def unsummed(self, x: torch.Tensor) -> "torch.Tensor | SplitSums":
        """``self(x)``, or where a held weight's decode-sized pass splits K, its partial sums
        (:class:`~hpc_kernels.split_sums.SplitSums`) for a kernel that adds them as it reads them
        (:meth:`RMSNorm.add`)."""
        if self.quant is not None and self.bias is None and x.dim() == 2:
            return self.quant.matmul(x, unsummed=True)
        return self(x)


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: ``norm(x) * (1 + w)`` in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = param(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused(x, self.weight):
            return norm_kernels.rms_norm(x, self.weight, self.eps)
        return norm_kernels.rms_norm_ref(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, r: "torch.Tensor | SplitSums") -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + r, self(x + r))``: the residual stream's sum and its norm (one launch where the
        fused kernels run; the same numbers as the sum then the norm). ``r`` may be a product's
        split sums (:meth:`Linear.unsummed`), added in the same launch."""
        if fused(x, self.weight, r if isinstance(r, torch.Tensor) else None):
            return norm_kernels.add_rms_norm(x, r, self.weight, self.eps)
        return norm_kernels.add_rms_norm_ref(x, r, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: ``w * norm(x)`` (plain weight, cast to x's dtype first) times ``silu(z)``."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = param(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if fused(x, self.weight, gate):
            return norm_kernels.gated_rms_norm(x, self.weight, gate, self.eps)
        return norm_kernels.gated_rms_norm_ref(x, self.weight, gate, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.gate_proj = Linear(hidden, intermediate, **fk)
        self.up_proj = Linear(hidden, intermediate, **fk)
        self.down_proj = Linear(intermediate, hidden, **fk)
        #: gate and up as one product (:mod:`hpc_cli.model.merged`), set once the weights are loaded
        self.merged: "MergedProjection | None" = None

    def forward(self, x: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        """``unsummed``: the down projection's split sums where it has them (:meth:`Linear.unsummed`)."""
        if self.merged is not None:
            gate, up = self.merged(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = swiglu.swiglu(gate, up) if fused(gate, up) else swiglu.swiglu_ref(gate, up)
        return self.down_proj.unsummed(act) if unsummed else self.down_proj(act)


class Rotary:
    """1-D rotary embedding over the first ``rotary_dim`` dims of a head (text-only mRoPE).

    With text positions the three mRoPE sections (t, h, w) carry the same position, so the
    interleaved mRoPE reduces to this plain rotary of ``rotary_dim = head_dim * 0.25`` dims.
    """

    def __init__(self, rotary_dim: int, theta: float, device=None) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
                                         / rotary_dim))
        #: dtype -> (cos, sin) ``[P, rotary_dim]`` of positions ``0 .. P-1`` (:meth:`hold_table`)
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        #: every table ever held: a CUDA graph captured while one was current reads its memory
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[N, rotary_dim]`` for integer positions ``[N]``, computed (seven launches on
        CUDA in bf16: a cast, a product, a concatenation, ``cos``, ``sin`` and two casts)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hold_table(self, positions: int, dtype: torch.dtype) -> None:
        """Keep :meth:`compute`'s values of positions ``0 .. positions-1`` in ``dtype`` on the
        device of ``inv_freq``, so that :meth:`cos_sin` reads rows instead of computing them (three
        launches instead of seven, in every decode step, verify pass and draft step). CUDA only:
        there an elementwise kernel computes each element alike whatever the tensor's length, so a
        row of the table is bit for bit what :meth:`compute` gives for that position (checked by
        ``tests/model/test_rotary_table.py`` on the GPU); on the CPU the vector body and the scalar
        tail of ``cos`` may differ in the last bit. Keeps the longer of two tables (and the shorter
        alive, for the graphs that read it)."""
        if self.inv_freq.device.type != "cuda":
            return
        held = self.tables.get(dtype)
        if held is not None and held[0].shape[0] >= positions:
            return
        if held is not None:
            self.retired.append(held)
        self.tables[dtype] = self.compute(torch.arange(positions, device=self.inv_freq.device), dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[N, rotary_dim]`` for integer positions ``[N]``: rows of the held table
        where there is one for ``dtype`` on their device, else computed. A position past the table
        reads its last row (a negative one its first): only padding rows go there (the engine holds its longest sequence plus
        a margin, :meth:`hold_table`), and a clamp keeps them from reading outside it."""
        held = self.tables.get(dtype)
        if held is None or held[0].device != positions.device:
            return self.compute(positions, dtype)
        cos, sin = held
        rows = positions.clamp(0, cos.shape[0] - 1)
        return cos.index_select(0, rows), sin.index_select(0, rows)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` ``[N, heads, head_dim]``; cos/sin ``[N, r]``."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary(norm(x), cos, sin)`` for heads ``x`` ``[N, H, d]``: one launch where the
    fused kernels run (:func:`hpc_kernels.rms_norm.rms_norm_rope`; the attention layers' and the
    drafters' q and k)."""
    if fused(x, norm.weight) and cos.dim() == 2 and cos.shape[0] == x.shape[0]:
        return norm_kernels.rms_norm_rope(x, norm.weight, norm.eps, cos.contiguous(), sin.contiguous())
    return apply_rotary(norm(x), cos, sin)
