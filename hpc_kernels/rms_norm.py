"""The two RMSNorms of the Qwen3.5 text stack, one launch per call, one program per row.

* ``rms_norm``: the zero-centred norm, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back
  to ``x``'s dtype (the layers' and attention heads' norm);
* ``rms_norm_rope``: that norm of the attention heads' q or k, then their rotary, in the same
  launch (its twin is the model's norm and rotary);
* ``add_rms_norm``: the residual stream's sum ``x + r`` (rounded to ``x``'s dtype) and that
  norm of it, in one launch (a decode step's residual adds and the norms after them); ``r`` may
  be a product's split sums (``hpc_kernels.split_sums``), added in the launch;
* ``gated_rms_norm``: the GDN output norm, ``w * norm(x)`` (the normed row cast to ``x``'s dtype
  first, then multiplied by the weight in that dtype) times ``silu(z)`` in fp32, cast back.

In torch each is 9-12 elementwise and reduction kernels; a decode step runs 27 of them (two a
layer, two per attention layer's heads, one per GDN layer's output, the final norm), so on a GPU
they were about half of a decode step's launches. Here each is one launch whatever the row
count: a program reads its row once, sums its squares in fp32 and writes the row.

A row's result depends on that row alone (one program, one reduction order, whatever the number
of rows), which the column pass's verify-equals-decode identity needs. The rows may sit at any
token and head strides (a head's rows inside a wider projection, as q's inside ``[query | gate]``
or k's inside a merged q/k/v product), read in place.
:func:`rms_norm_ref` and :func:`gated_rms_norm_ref` are the torch twins (the model's CPU path);
the kernels run under Triton's interpreter too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_kernels.launch import as_heads, as_rows, launchable, tl, triton
from hpc_kernels.split_sums import SplitSums, summed


if triton is not None:
    @triton.jit
    def _norm_kernel(x, w, z, y, s, cos, sin, heads, D, eps, sx, sxh, sz, szh, sy, szs, BLOCK: tl.constexpr,
                     GATED: tl.constexpr, RD: tl.constexpr, ADD: tl.constexpr, SPLITS: tl.constexpr):
        # row r is head r % heads of token r // heads; x and z at strides (token, head, 1), y dense.
        # ADD (one head a row): the row is x + z rounded to x's dtype, also written to s (as y);
        # with SPLITS, z is a product's fp32 split sums (split i at z + i * szs), added in order
        # and rounded to x's dtype first, as the product would have
        row = tl.program_id(0).to(tl.int64)
        tok = row // heads
        hd = row % heads
        xrow = x + tok * sx + hd * sxh
        o = tl.arange(0, BLOCK)
        m = o < D
        if ADD:
            if SPLITS > 0:
                zf = tl.zeros([BLOCK], dtype=tl.float32)
                for i in tl.static_range(SPLITS):
                    zf += tl.load(z + i * szs + tok * sz + o, mask=m, other=0.0)
                zf = zf.to(y.dtype.element_ty).to(tl.float32)
            else:
                zf = tl.load(z + tok * sz + o, mask=m, other=0.0).to(tl.float32)
            xs = (tl.load(xrow + o, mask=m, other=0.0).to(tl.float32) + zf).to(y.dtype.element_ty)
            tl.store(s + row * sy + o, xs, mask=m)
            xf = xs.to(tl.float32)
        else:
            xf = tl.load(xrow + o, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        wv = tl.load(w + o, mask=m, other=0.0)
        if RD > 0:
            # then rotary on the first RD dims, in the output dtype as torch's: x*cos + rotate(x)*sin,
            # each product rounded, then the sum; rotate(x)[i] = -x[i + RD/2] below RD/2, else x[i - RD/2]
            dt = y.dtype.element_ty
            yn = (xf * r * (1.0 + wv.to(tl.float32))).to(dt)
            half: tl.constexpr = RD // 2
            m_r = o < RD
            p = tl.where(o < half, o + half, o - half)
            xp = tl.load(xrow + p, mask=m_r, other=0.0).to(tl.float32)
            wp = tl.load(w + p, mask=m_r, other=0.0).to(tl.float32)
            partner = (xp * r * (1.0 + wp)).to(dt).to(tl.float32)
            partner = tl.where(o < half, -partner, partner)
            c = tl.load(cos + tok * RD + o, mask=m_r, other=0.0).to(tl.float32)
            s = tl.load(sin + tok * RD + o, mask=m_r, other=0.0).to(tl.float32)
            rot = ((yn.to(tl.float32) * c).to(dt).to(tl.float32) + (partner * s).to(dt).to(tl.float32)).to(dt)
            out = tl.where(m_r, rot, yn).to(tl.float32)
        elif GATED:
            # w * norm(x) in x's dtype (the normed row rounded first), then * silu(z) in fp32
            yw = ((xf * r).to(y.dtype.element_ty).to(tl.float32) * wv.to(tl.float32)).to(y.dtype.element_ty)
            zf = tl.load(z + tok * sz + hd * szh + o, mask=m, other=0.0).to(tl.float32)
            out = yw.to(tl.float32) * (zf / (1.0 + tl.exp(-zf)))
        else:
            out = xf * r * (1.0 + wv.to(tl.float32))
        tl.store(y + row * sy + o, out.to(y.dtype.element_ty), mask=m)


def _launch(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor | None, eps: float,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None, added: torch.Tensor | None = None,
            splits: tuple[int, int] = (0, 0)) -> torch.Tensor:
    D = x.shape[-1]
    assert w.shape == (D,), f"weight {tuple(w.shape)} for rows of {D}"
    x3 = as_heads(x)
    z3 = as_heads(z) if z is not None else x3
    assert z3.shape == x3.shape, f"gate {tuple(z.shape)} for rows {tuple(x.shape)}"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, D)
    n = y2.shape[0]
    if n:
        block = triton.next_power_of_2(D)
        warps = 1 if block <= 256 else 4 if block <= 2048 else 8
        cos, sin = rope if rope is not None else (x3, x3)
        rd = cos.shape[-1] if rope is not None else 0
        if added is not None:  # x + z into added, then its norm
            assert rope is None and x3.shape[1] == 1 and added.shape == x.shape and added.is_contiguous(), \
                "an added residual takes rows of one head and a dense output"
        if rope is not None:
            assert x.dim() == 3 and cos.shape == sin.shape == (x.shape[0], rd) and cos.is_contiguous() \
                and sin.is_contiguous() and rd % 2 == 0 and rd <= D, \
                f"rotary cos/sin {tuple(cos.shape)} for rows {tuple(x.shape)}"
        heads = x3.shape[1]
        _norm_kernel[(n,)](x3, w, z3, y2, y2 if added is None else added, cos, sin, heads, D, eps, x3.stride(0),
                           x3.stride(1), z3.stride(0), z3.stride(1), y2.stride(0), splits[1], BLOCK=block,
                           GATED=z is not None and added is None, RD=rd, ADD=added is not None, SPLITS=splits[0],
                           num_warps=warps)
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The zero-centred RMSNorm of ``x`` ``[..., D]`` over its last dim (one launch)."""
    if not launchable(x):
        return rms_norm_ref(x, w, eps)
    return _launch(x, w, None, eps)


def add_rms_norm(x: torch.Tensor, r: "torch.Tensor | SplitSums", w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r`` (rounded to ``x``'s dtype, as torch's sum) and :func:`rms_norm` of ``s``, in
    one launch: the residual stream's sum and the next norm (``[..., D]`` operands). ``r`` may be
    a product's :class:`SplitSums` (``x`` ``[M, D]``): they are added, in order, in the launch."""
    if not launchable(x):
        return add_rms_norm_ref(x, r, w, eps)
    splits = (0, 0)
    if isinstance(r, SplitSums):
        assert x.dim() == 2 and r.shape == x.shape and r.dtype == x.dtype, \
            f"split sums {tuple(r.shape)} {r.dtype} for rows {tuple(x.shape)} {x.dtype}"
        splits, r = (r.splits, r.parts.stride(0)), r.parts[0]
    assert r.shape == x.shape and (r.dtype == x.dtype or splits[0]), \
        f"residual {tuple(r.shape)} {r.dtype} for {tuple(x.shape)}"
    x2, r2 = as_rows(x), as_rows(r)  # one head a row: the kernel's rows are the tokens
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = _launch(x2, w, r2, eps, added=s, splits=splits)
    return s.view(x.shape), y.view(x.shape)


def rms_norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rms_norm` of the heads ``x`` ``[N, H, D]``, then rotary on their first
    ``cos.shape[-1]`` dims with ``cos``/``sin`` ``[N, rd]`` (one launch; the attention layer's
    q and k). Its twin is the model's own: ``apply_rotary(rms_norm_ref(x), cos, sin)``
    (:mod:`hpc_cli.model.layers`), which the caller runs where the kernel cannot launch."""
    assert launchable(x), "the fused rope norm launches on CUDA or under Triton's interpreter"
    return _launch(x, w, None, eps, (cos, sin))


def gated_rms_norm(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm of ``x`` ``[..., D]`` gated by ``silu(z)`` (one launch)."""
    if not launchable(x):
        return gated_rms_norm_ref(x, w, z, eps)
    return _launch(x, w, z, eps)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).type_as(x)


def add_rms_norm_ref(x: torch.Tensor, r: "torch.Tensor | SplitSums", w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + summed(r)
    return s, rms_norm_ref(s, w, eps)


def gated_rms_norm_ref(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = w * y.to(dtype)
    return (y * F.silu(z.float())).to(dtype)
