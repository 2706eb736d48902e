"""DFlash2's candidate selector in one launch: per row of logits, its top ``C`` tokens rescored by
a low-rank product, and the best of them.

The selector (``hpc_cli.speculative.dflash``) takes the target head's top ``C`` candidates of a
drafting column and adds ``(A h) . (B e_c) / sqrt(r)`` to each candidate's logit, where ``h`` is the
column's final hidden, ``e_c`` the candidate's embedding, ``A`` and ``B`` the selector's two ``[r,
H]`` projections; the draft is the best candidate. In torch that is a top-k (a radix select and a
sort: on an H100 about 28 us of a round's device time for one row of a 6k vocabulary), an
embedding gather, two products, a batched dot, the casts, an argmax and a gather: some twelve
launches. Here one program per row does all of it:

* the top ``C`` logits by ``C`` max-reductions over keys that pack an order-preserving integer
  image of each logit with its index (the larger logit first, the smaller index on a tie, as a
  sort that keeps the first of equals would);
* ``u = B^T (A h)`` in fp32, then each candidate's dot ``e_c . u`` (the same sum as ``(B e_c) .
  (A h)``, grouped the other way: ``r x H`` multiply-adds once instead of once a candidate);
* the candidate with the largest ``logit + dot * scale`` (the first on a tie, the larger logit).

The whole row sits in one program's registers, so the kernel takes vocabularies up to
:data:`MAX_VOCAB`; past that :func:`supports` says no and the caller keeps torch's path.
:func:`select_ref` is the torch twin (the same fp32 sums); the kernel runs under Triton's
interpreter too.
"""

from __future__ import annotations

import torch

from hpc_kernels.launch import tl, triton

#: the largest vocabulary one program holds (its logits' keys in registers)
MAX_VOCAB = 32768
#: hidden columns a program reads at a time
BLOCK_H = 128


if triton is not None:
    @triton.jit
    def _select_kernel(logits, sl, hid, sh, wa, wb, emb, out, V, H, R, scale,
                       C: tl.constexpr, C_PAD: tl.constexpr, BLOCK_V: tl.constexpr, R_PAD: tl.constexpr,
                       BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ov = tl.arange(0, BLOCK_V)
        x = tl.load(logits + row * sl + ov, mask=ov < V, other=float("-inf")).to(tl.float32)
        # an integer image of x in x's order: flip the magnitude bits of negative floats
        b = x.to(tl.int32, bitcast=True)
        key = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)
        lowest = tl.full([BLOCK_V], 1, tl.int64) << 63  # below every key
        keys = tl.where(ov < V, (key << 32) | (V - 1 - ov).to(tl.int64), lowest)
        oc = tl.arange(0, C_PAD)
        cand = tl.zeros([C_PAD], dtype=tl.int64)
        vals = tl.full([C_PAD], float("-inf"), dtype=tl.float32)
        for i in tl.static_range(C):
            best = tl.max(keys, 0)
            idx = (V - 1) - (best & 0xFFFFFFFF)
            cand = tl.where(oc == i, idx, cand)
            vals = tl.where(oc == i, tl.load(logits + row * sl + idx).to(tl.float32), vals)
            keys = tl.where(keys == best, lowest, keys)
        # q = A h, then u = B^T q a block of hidden columns at a time, each candidate's e . u with it
        orr = tl.arange(0, R_PAD)
        mr = orr < R
        q = tl.zeros([R_PAD], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            oh = h0 + tl.arange(0, BLOCK_H)
            mh = oh < H
            hv = tl.load(hid + row * sh + oh, mask=mh, other=0.0).to(tl.float32)
            a = tl.load(wa + orr[:, None] * H + oh[None, :], mask=mr[:, None] & mh[None, :], other=0.0)
            q += tl.sum(a.to(tl.float32) * hv[None, :], 1)
        dot = tl.zeros([C_PAD], dtype=tl.float32)
        mc = oc < C
        for h0 in range(0, H, BLOCK_H):
            oh = h0 + tl.arange(0, BLOCK_H)
            mh = oh < H
            w = tl.load(wb + orr[:, None] * H + oh[None, :], mask=mr[:, None] & mh[None, :], other=0.0)
            u = tl.sum(w.to(tl.float32) * q[:, None], 0)
            e = tl.load(emb + cand[:, None] * H + oh[None, :], mask=mc[:, None] & mh[None, :], other=0.0)
            dot += tl.sum(e.to(tl.float32) * u[None, :], 1)
        score = tl.where(mc, vals + dot * scale, float("-inf"))
        win = tl.argmax(score, 0, tie_break_left=True)
        tl.store(out + row, tl.sum(tl.where(oc == win, cand, 0), 0))


def supports(vocab: int, candidates: int) -> bool:
    """Whether the kernel takes a vocabulary of ``vocab`` with ``candidates`` a row."""
    return triton is not None and 1 <= candidates <= vocab <= MAX_VOCAB


def select(logits: torch.Tensor, hid: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, embed: torch.Tensor,
           candidates: int, scale: float) -> torch.Tensor:
    """The drafts ``[N]`` (int64) of ``N`` rows: ``logits`` ``[N, V]``, the final hidden ``hid``
    ``[N, H]``, the selector's projections ``wa``, ``wb`` ``[r, H]``, the token embeddings
    ``embed`` ``[V', H]`` (``V' >= V``), the top ``candidates`` of each row rescored by
    ``(wa h) . (wb e_c) * scale``."""
    N, V = logits.shape
    R, H = wa.shape
    assert supports(V, candidates), f"a vocabulary of {V} with {candidates} candidates is past the kernel"
    assert hid.shape == (N, H) and wb.shape == (R, H) and embed.shape[1] == H, \
        f"hid {tuple(hid.shape)}, wa {tuple(wa.shape)}, wb {tuple(wb.shape)}, embed {tuple(embed.shape)}"
    assert logits.stride(-1) == 1 and hid.stride(-1) == 1, "rows need unit stride along the last dim"
    wa, wb, embed = wa.contiguous(), wb.contiguous(), embed.contiguous()
    out = torch.empty(N, dtype=torch.long, device=logits.device)
    if N:
        block_v = triton.next_power_of_2(V)
        _select_kernel[(N,)](logits, logits.stride(0), hid, hid.stride(0), wa, wb, embed, out, V, H, R, scale,
                             C=candidates, C_PAD=max(2, triton.next_power_of_2(candidates)), BLOCK_V=block_v,
                             R_PAD=max(2, triton.next_power_of_2(R)), BLOCK_H=BLOCK_H,
                             num_warps=8 if block_v >= 8192 else 4)
    return out


def select_ref(logits: torch.Tensor, hid: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, embed: torch.Tensor,
               candidates: int, scale: float) -> torch.Tensor:
    """:func:`select`'s torch twin: the same candidates (ties to the smaller index) and the same
    fp32 sums, grouped as the kernel groups them."""
    V = logits.shape[1]
    x = logits.float()
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :candidates]  # ties: smaller index first
    vals = x.gather(1, order)
    u = (hid.float() @ wa.float().t()) @ wb.float()  # [N, H]
    e = embed[:V].float()[order]  # [N, C, H]
    score = vals + (e * u[:, None, :]).sum(-1) * scale
    return order.gather(1, score.argmax(1, keepdim=True))[:, 0]
