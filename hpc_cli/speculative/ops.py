"""Model-level operations of speculative decoding: paged multi-query attention, the verify pass
and the rollback of the GDN state (docs/speculative.md).

The verify pass scores, for each of ``B`` lanes, ``T = k + 1`` tokens (the last accepted token
and ``k`` drafts) at positions ``start_b .. start_b + T - 1`` in ONE pass over the paged KV. It is
the very code :meth:`HybridModel.decode` runs (:func:`hpc_cli.model.columns.columns_pass` with
one column), so a verified column is bit-identical to one-token decode, in bf16 too.

Rollback of the recurrent state (measured in docs/speculative.md, ``benchmarks/spec_decode.py
--rollback``):

* ``per_token`` (default): the verify pass keeps the GDN state and conv window after *every*
  column; :func:`commit_states` writes the one after the last accepted column into the slot.
* ``recompute``: the slot's image is snapshotted before the pass, the pass writes its final
  state, and a lane that rejected a draft gets the snapshot back and re-runs its accepted prefix.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hpc_cli.model.columns import ColumnIndex, ColumnsOut, columns_pass, graph_width, table_width
from hpc_cli.speculative.round_tail import greedy_counts


def padded_rows(tables: Sequence[Sequence[int]], last_pos: Sequence[int], page: int,
                graph: bool = False) -> tuple[list[list[int]], int]:
    """Each lane's page table covering position ``last_pos[b]``, padded with its first page to
    one width (``graph``: a decode graph's width, :func:`~hpc_cli.model.columns.graph_width`), as
    host rows, and that width."""
    need = [p // page + 1 for p in last_pos]
    width = graph_width(max(need)) if graph else max(need)
    rows = []
    for bt, n, p in zip(tables, need, last_pos):
        assert len(bt) >= n, f"block table has {len(bt)} pages, position {p} needs {n}"
        row = list(bt[:n])
        rows.append(row + [row[0]] * (width - n))
    return rows, width


def padded_table(tables: Sequence[Sequence[int]], last_pos: Sequence[int], page: int, device,
                 graph: bool = False) -> tuple[torch.Tensor, int]:
    """:func:`padded_rows` as a tensor ``[B, width]`` on ``device``."""
    rows, width = padded_rows(tables, last_pos, page, graph)
    return torch.tensor(rows, dtype=torch.long, device=device), width


def _write(kv, layer: int, table: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           write: Sequence[bool] | torch.Tensor | None) -> None:
    page = kv.page_tokens
    slots = (table.gather(1, pos // page) * page + pos % page).reshape(-1)
    if torch.is_tensor(write):  # per lane on the device (a captured step): a negative slot writes nothing
        keep = write[:, None].expand(pos.shape).reshape(-1)
        kv.write(layer, torch.where(keep, slots, torch.full_like(slots, -1)), k, v)
        return
    if write is None or all(write):
        kv.write(layer, slots, k, v)
        return
    if not any(write):
        return
    T = pos.shape[1]
    rows = torch.tensor([b * T + t for b, w in enumerate(write) if w for t in range(T)], device=slots.device)
    kv.write(layer, slots.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows))


def column_writes(idx, T: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``T`` columns of a verify pass's index ``idx`` as a drafter's catch-up writes them
    (device values only, capturable): their positions ``[B, T]``, which are kept (column ``t <
    counts[b]``) and the pass's KV write slots, ``-1`` past a lane's count (a built-in profile's
    pool skips them)."""
    pos = idx.seqlens[:, :T] - 1  # the lengths are positions + 1
    keep = torch.arange(T, device=counts.device)[None, :] < counts[:, None]
    return pos, keep, torch.where(keep, idx.write[:, :T], -1)


def write_kv(attn, h: torch.Tensor, pos: torch.Tensor, last: Sequence[int], tables: Sequence[Sequence[int]], kv,
             layer: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The K/V :func:`paged_attention` writes for ``h`` at ``pos`` ``[B, T]`` (``last``: each
    lane's last position, known on the host), without its queries and attention (a drafter
    catching its K/V up to committed positions)."""
    k, v = attn.kv(h, cos, sin)
    table, _ = padded_table(tables, last, kv.page_tokens, h.device)
    _write(kv, layer, table, pos, k, v, None)


def paged_attention(attn, h: torch.Tensor, pos: torch.Tensor, last: Sequence[int], tables: Sequence[Sequence[int]],
                    kv, layer: int, cos: torch.Tensor, sin: torch.Tensor,
                    write: Sequence[bool] | torch.Tensor | None = None,
                    table: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """A gated attention layer for ``B`` lanes x ``T`` queries at positions ``pos`` ``[B, T]``
    (``last``: each lane's last position, known on the host, so nothing here waits for the
    device): the new K/V are written into the lanes' pages of ``kv`` layer ``layer``, then every
    query reads its lane's pages causally (key position <= its own). ``h`` ``[B*T, hidden]``;
    ``write`` (per lane, a list or a bool tensor on the device; the tensor form only on a
    built-in profile's pool, whose writes skip negative slots): False keeps a lane's K/V out of
    the pages (it is already there);
    ``table``: the padded page table and its width, built once by the caller for several calls
    (:func:`page_table`). One query per lane (``T == 1``) on a pool the paged decode kernel reads
    goes through that kernel; otherwise the span is gathered and SDPA runs with a causal mask."""
    T = pos.shape[1]
    q, gate, k, v = attn.qkv(h, cos, sin)
    in_place = reads_in_place(attn, kv, T)
    table, width = table if table is not None else page_table(attn, kv, tables, last, T, h.device)
    _write(kv, layer, table, pos, k, v, write)
    if in_place:
        o = kv.decode_attention(layer, q, table, pos[:, 0] + 1, attn.scale)
        return attn.finish(o, gate)
    return attn.finish(span_attention(attn, q, pos, table, width, kv, layer), gate)


def span_attention(attn, q: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, width: int, kv,
                   layer: int) -> torch.Tensor:
    """Each lane's ``T`` queries (``q`` ``[B * T, heads, head_dim]`` at positions ``pos`` ``[B,
    T]``) over its ``width`` pages of ``table`` ``[B, >= width]``, gathered from ``kv`` layer
    ``layer`` and masked causally (keys up to each query's own position): ``[B * T, heads,
    head_dim]``, before the output gate."""
    B, T = pos.shape
    span = width * kv.page_tokens
    keys, values = kv.gather(layer, table[:, :width].reshape(-1), B * span, q.dtype)
    keys = keys.view(B, span, attn.n_kv, attn.head_dim).transpose(1, 2)
    values = values.view(B, span, attn.n_kv, attn.head_dim).transpose(1, 2)
    mask = (torch.arange(span, device=q.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B,1,T,S]
    qh = q.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    o = attn.attend(qh, keys, values, mask)  # [B, H, T, d]
    return o.transpose(1, 2).reshape(B * T, attn.n_heads, attn.head_dim)


def reads_in_place(attn, kv, T: int) -> bool:
    """Whether :func:`paged_attention` of ``T`` queries per lane reads ``kv``'s pages with the
    paged decode kernel (one query per lane, a pool the kernel reads) rather than gathering."""
    return T == 1 and kv.paged_attention_supported(attn.n_heads)


def page_table(attn, kv, tables: Sequence[Sequence[int]], last_pos: Sequence[int], T: int,
               device) -> tuple[torch.Tensor, int]:
    """The padded page table ``[B, width]`` (and its width) covering position ``last_pos[b]`` of
    each lane, for :func:`paged_attention` of ``T`` queries per lane. Where the paged decode
    kernel reads it, its width is a decode graph's (a power of two, >= 8), the widths the warm-up
    compiles that kernel for, so a draft step compiles nothing while serving."""
    return padded_table(tables, last_pos, kv.page_tokens, device, graph=reads_in_place(attn, kv, T))


def page_rows(attn, kv, tables: Sequence[Sequence[int]], last_pos: Sequence[int], T: int
              ) -> tuple[list[list[int]], int]:
    """:func:`page_table` as host rows (a graph's packed inputs)."""
    return padded_rows(tables, last_pos, kv.page_tokens, graph=reads_in_place(attn, kv, T))


#: the verify pass's result (logits, hidden, features, per-column windows and states)
VerifyOut = ColumnsOut


@torch.inference_mode()
def verify_pass(model, tokens: torch.Tensor | Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[Sequence[int]],
                slots: Sequence[int], kv, states, *, keep_all: bool, capture: Sequence[int] = (),
                drafts: torch.Tensor | None = None, second: bool = False) -> VerifyOut:
    """Score ``tokens`` ``[B, T]`` (a tensor or host rows) at ``starts[b] + t``: the column pass that
    :meth:`HybridModel.decode` runs with one column, so column ``t`` is bit-identical to decoding
    that token (hpc_cli.model.columns). With ``keep_all`` the slots are left untouched and the
    per-column states come back (commit with :func:`commit_states`); without it the final state
    of every lane is written to its slot (the ``recompute`` rollback). On CUDA the pass runs
    through the model's graphs (hpc_cli.model.graphs), whose outputs live until the next pass of
    the same shape: consume them within the round. ``drafts`` ``[B, T - 1]`` on the device:
    the draft columns of ``tokens``, read there (a proposal the host has not waited for).
    ``second``: through the shape's second graph (the warm-up's, for :func:`chained_verify`)."""
    graphs = model.column_graphs(kv)
    if graphs is not None:
        return graphs.run(tokens.cpu() if torch.is_tensor(tokens) else tokens, starts, tables, slots, kv, states,
                          keep_all=keep_all, capture=capture, drafts=drafts, second=second)
    return columns_pass(model, torch.as_tensor(tokens, dtype=torch.long), starts, tables, slots, kv, states, keep_all=keep_all, capture=capture,
                        drafts=drafts)


#: :meth:`ColumnIndex.lanes_of` on the device, by shape and device (a few shapes: the warm-up's)
_LANES_OF: dict[tuple, torch.Tensor] = {}


def lanes_of(B: int, T: int, W: int, device: torch.device) -> torch.Tensor:
    """:meth:`ColumnIndex.lanes_of` on ``device``, made once a shape."""
    key = (B, T, W, str(device))
    t = _LANES_OF.get(key)
    if t is None:
        t = _LANES_OF[key] = torch.tensor(ColumnIndex.lanes_of(B, T, W), dtype=torch.long, device=device)
    return t


def fill_chained(idx: ColumnIndex, variants: torch.Tensor, lanes: torch.Tensor, verdict: torch.Tensor,
                 drafts: torch.Tensor) -> None:
    """The next round's verify index on the device, from a greedy round's ``verdict`` ``[B, 2T -
    1]`` (no host read, capturable): each lane's positions, write slots, lengths and page table
    are those of variant ``c`` of ``variants`` ``[T, L]`` (the packed index of the next round
    after ``c`` accepted drafts) at its count ``c`` of accepted drafts; its first token the
    argmax at column ``c`` (the token the host emits there); its drafts ``drafts`` ``[B, T - 1]``
    (the proposal made ahead)."""
    k = idx.T - 1
    counts = greedy_counts(verdict)
    idx.choose(variants, counts, lanes)
    idx.tokens.view(idx.B, idx.T)[:, 0].copy_(verdict[:, k:].gather(1, counts[:, None])[:, 0])
    idx.put_drafts(drafts)


@torch.inference_mode()
def chained_verify(model, kv, states, starts: Sequence[Sequence[int]], tables: Sequence[Sequence[Sequence[int]]],
               slots: Sequence[int], *, capture: Sequence[int], verdict: torch.Tensor, drafts: torch.Tensor,
               avoid: int) -> VerifyOut | None:
    """The next round's verify pass, launched before the host reads this round's ``verdict``:
    ``starts[c]`` and ``tables[c]`` are the lanes' next starts and page tables after ``c``
    accepted drafts (``c`` = 0..k), and each lane takes its own count's
    (:func:`fill_chained`), all in one host-to-device copy and a captured pass. The pass is
    the one the host would launch after accepting, bit for bit, where every lane accepts what
    the device counted. None where the lanes' variants need other table widths or no graph of
    the shape is captured whose outputs are not ``avoid`` (this round's, still to be read)."""
    graphs = model.column_graphs(kv)
    if graphs is None:
        return None
    B, T, page = len(slots), len(starts), kv.page_tokens
    widths = {table_width(tb, st, T, page) for st, tb in zip(starts, tables)}
    if len(widths) != 1:
        return None
    W = widths.pop()
    rows = [[0] * T for _ in range(B)]
    values = [ColumnIndex.pack_values(rows, st, tb, slots, page, W) for st, tb in zip(starts, tables)]
    flat = np.concatenate([np.asarray(v, dtype=np.int64) for v in values]) \
        if any(isinstance(v, np.ndarray) for v in values) else [x for v in values for x in v]
    staged = graphs.staging.stage(flat)
    return graphs.replay_filled(B, T, W, kv, states, keep_all=True, capture=capture,
                                fill=_chained_fill(B, T, W, model.device), staged=staged, inputs=(verdict, drafts),
                                avoid=avoid)


def _chained_fill(B: int, T: int, W: int, device: torch.device):
    """:func:`fill_chained` as :meth:`ColumnGraphs.replay_filled` calls it, with the shape's lane map."""
    lanes = lanes_of(B, T, W, device)

    def fill(idx: ColumnIndex, sent: torch.Tensor, verdict: torch.Tensor, drafts: torch.Tensor) -> None:
        fill_chained(idx, sent.view(T, -1), lanes, verdict, drafts)

    return fill


@torch.inference_mode()
def warm_chained(model, kv, states, B: int, T: int, W: int, *, capture: Sequence[int], verdict: torch.Tensor) -> int:
    """Capture the graphs that fill a chained verify pass's index of ``B`` x ``T`` x ``W`` for both
    graphs of the shape, at the warm-up. Returns the fills captured."""
    graphs = model.column_graphs(kv)
    if graphs is None:
        return 0
    drafts = torch.zeros(B, T - 1, dtype=torch.long, device=model.device)
    return graphs.warm_fill(B, T, W, kv, states, keep_all=True, capture=capture,
                            fill=_chained_fill(B, T, W, model.device),
                            staged=len(ColumnIndex.lanes_of(B, T, W)) * T, inputs=(verdict, drafts))


@torch.inference_mode()
def commit_states(states, out: VerifyOut, slots: Sequence[int], keep: Sequence[int]) -> None:
    """Write into each lane's slot the state after column ``keep[b]`` (the last accepted one)."""
    dev = out.hidden.device
    commit_columns(states, out, torch.tensor(list(slots), dtype=torch.long, device=dev),
                   torch.tensor(list(keep), dtype=torch.long, device=dev))


def commit_columns(states, out: VerifyOut, slot_t: torch.Tensor, j: torch.Tensor) -> None:
    """:func:`commit_states` on device tensors (``slot_t``, ``j`` ``[B]``): no host value read,
    so a round's tail can be captured (:mod:`hpc_cli.speculative.round_tail`)."""
    dev = out.hidden.device
    B, T = out.hidden.shape[:2]
    flat = torch.arange(0, B * T, T, device=dev) + j  # row b * T + keep[b] of the [B * T, ...] views
    assert out.stacked is not None or not out.windows, "a verify pass keeps its windows and states stacked"
    if out.stacked is not None:  # every GDN layer's in one gather and one copy each
        windows, kept = out.stacked
        G, _, C, _ = windows.shape
        K1 = states.conv_all.shape[-1]
        cols = j[:, None] + torch.arange(1, K1 + 1, device=dev)[None]  # [B, K-1] columns of the window
        sel = windows.gather(3, cols[None, :, None, :].expand(G, B, C, K1))
        states.conv_all.index_copy_(1, slot_t, sel.to(states.conv_all.dtype))
        # index_select of the flattened rows: the same values as kept[:, ar, j], several times cheaper on CPU
        states.recurrent_all.index_copy_(1, slot_t, kept.index_select(1, flat))
    states.hidden.index_copy_(0, slot_t, out.hidden.flatten(0, 1).index_select(0, flat).to(states.hidden.dtype))


class Snapshot:
    """The ``recompute`` rollback's copy of some slots' images taken before a verify pass."""

    def __init__(self, states, slots: Sequence[int]) -> None:
        dev = states.hidden.device
        self.slots = torch.tensor(list(slots), dtype=torch.long, device=dev)
        self.conv = states.conv_all.index_select(1, self.slots)
        self.rec = states.recurrent_all.index_select(1, self.slots)
        self.hidden = states.hidden.index_select(0, self.slots)

    def restore(self, states, which: Sequence[int]) -> None:
        """Put back the images of lanes ``which`` (indices into the snapshot's slots)."""
        w = torch.tensor(list(which), dtype=torch.long, device=self.slots.device)
        s = self.slots.index_select(0, w)
        states.conv_all.index_copy_(1, s, self.conv.index_select(1, w))
        states.recurrent_all.index_copy_(1, s, self.rec.index_select(1, w))
        states.hidden.index_copy_(0, s, self.hidden.index_select(0, w))
