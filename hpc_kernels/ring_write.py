"""DFlash2's ring catch-up for one drafter layer in one launch: the context K/V of a verify pass's
columns into each lane's ring, only the columns a lane committed, with what the ring held before.

A round's catch-up (``hpc_cli.speculative.dflash``) writes the context K/V of each lane's
accepted columns at ring slot ``position % window`` of its state slot's rings, and returns what
every column's ring slot held before (the runtime puts it back past a lane's count where the host's
count turns out lower). In torch that is the slots' arithmetic, a gather of the old rows, a stack
of K and V, a choice between new and old rows and an ``index_put``: five or more launches a layer.
Here one program per (lane, column) copies the slot's old K and V rows into ``saved`` and, where
the column is below the lane's count, writes the new ones. A lane's columns sit at distinct
positions below the window apart, so no two programs touch one ring slot. :func:`ring_write_ref`
is the torch twin; the kernel runs under Triton's interpreter too.
"""

from __future__ import annotations

import torch

from hpc_kernels.launch import tl, triton


if triton is not None:
    @triton.jit
    def _ring_kernel(ring, s_slot, s_side, s_pos, slots, seqlens, s_len, counts, k, sk, v, sv, saved, s_saved_row,
                     s_saved_side, T, W, E: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64)
        o = tl.arange(0, BLOCK)
        m = o < E
        w = (tl.load(seqlens + b * s_len + t).to(tl.int64) - 1) % W  # the lengths are positions + 1
        base = ring + tl.load(slots + b).to(tl.int64) * s_slot + w * s_pos
        out = saved + (b * T + t) * s_saved_row
        old_k = tl.load(base + o, mask=m)
        old_v = tl.load(base + s_side + o, mask=m)
        tl.store(out + o, old_k, mask=m)
        tl.store(out + s_saved_side + o, old_v, mask=m)
        lim = tl.where(t < tl.load(counts + b), E, 0)  # a column past the lane's count keeps the ring's row
        row = b * T + t
        tl.store(base + o, tl.load(k + row * sk + o, mask=o < lim).to(old_k.dtype), mask=o < lim)
        tl.store(base + s_side + o, tl.load(v + row * sv + o, mask=o < lim).to(old_v.dtype), mask=o < lim)


def ring_write(rings: torch.Tensor, layer: int, slots: torch.Tensor, seqlens: torch.Tensor, counts: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, saved: torch.Tensor) -> None:
    """Write layer ``layer``'s context ``k``, ``v`` ``[B * T, kv, d]`` (lane-major columns, heads
    adjacent) of column ``t < counts[b]`` of lane ``b`` into ``rings`` ``[slots, layers, K|V,
    window, kv, d]`` at state slot ``slots[b]``, ring slot ``(seqlens[b, t] - 1) % window``; every
    column's old K and V rows go to ``saved[b, t, layer]`` (``saved`` ``[B, T, layers, K|V, kv,
    d]``)."""
    N, L, _, W, KV, D = rings.shape
    B, T = saved.shape[:2]
    E = KV * D
    assert rings.stride(4) == D and rings.stride(5) == 1, "a ring row's heads adjacent"
    assert k.shape[0] == v.shape[0] == B * T and k.stride(1) == v.stride(1) == D and k.stride(2) == v.stride(2) == 1
    assert saved.is_contiguous() and saved.shape[2:] == (L, 2, KV, D), f"saved {tuple(saved.shape)}"
    assert seqlens.stride(1) == 1, "a lane's lengths adjacent"
    if B * T:
        ring = rings[:, layer]
        _ring_kernel[(B, T)](ring, ring.stride(0), ring.stride(1), ring.stride(2), slots, seqlens, seqlens.stride(0),
                             counts, k, k.stride(0), v, v.stride(0), saved[:, :, layer], saved.stride(1),
                             saved.stride(3), T, W, E=E, BLOCK=triton.next_power_of_2(E), num_warps=1)


def ring_write_ref(rings: torch.Tensor, layer: int, slots: torch.Tensor, seqlens: torch.Tensor, counts: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, saved: torch.Tensor) -> None:
    """:func:`ring_write`'s torch twin (the drafter's own ops)."""
    B, T = saved.shape[:2]
    W = rings.shape[3]
    view = rings[:, layer].permute(0, 2, 1, 3, 4)  # [N, W, K|V, kv, d]
    where = (slots[:, None], (seqlens[:, :T] - 1) % W)
    old = view[where]  # [B, T, K|V, kv, d]
    saved[:, :, layer] = old
    keep = torch.arange(T, device=counts.device)[None, :] < counts[:, None]
    new = torch.stack([k, v], 1).view(B, T, 2, *k.shape[1:]).to(view.dtype)
    view.index_put_(where, torch.where(keep[..., None, None, None], new, old))
