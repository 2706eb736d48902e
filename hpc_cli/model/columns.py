"""The column pass: ``T`` tokens for each of ``B`` lanes at consecutive positions, computed so
that every token's result is bit-identical to the one-token decode of that token.

One code path serves both :meth:`HybridModel.decode` (``T == 1``) and the speculative verify
pass (``T == k + 1``, :func:`hpc_cli.speculative.ops.verify_pass`). Why the results agree by
construction, also in bf16 and on CUDA (docs/speculative.md, "Bit-identical verify"):

* **Row-wise ops run on fixed row blocks.** Everything that treats tokens independently
  (embedding, RMSNorms, every projection, the gated norm, the MLP, ``lm_head``) runs on blocks of
  exactly ``row_block`` rows (the rows are padded with token 0; more rows run as several blocks).
  A GEMM or a reduction kernel picks its algorithm (tiling, split-K, threads per row) from the
  shape, so ``[B, H]`` and ``[B*(k+1), H]`` may round differently; one fixed shape means one
  kernel and one reduction order for every row, whatever the number of lanes or columns.
* **Per-lane ops run column by column with decode's shapes.** The conv window (a product-sum
  over a contiguous ``[B, C, K]`` window, then silu and the gates on contiguous ``[B, ...]``
  operands), the gated delta rule (the decode kernel on
  ``[B, 1, ...]``, one program per lane and head) are the very calls decode makes, in decode's
  order. Attention writes every column's K/V, then reads the pages for every column's query in
  one launch of the paged decode kernel (decode's kernel and launch, ``B * T`` rows: a program
  per row, KV head and split, so a row's result never depends on the other rows); a row reads
  exactly its own lane's pages up to its own position (a later column's K/V, already written,
  is masked as the stale K/V there is in decode), so its key span never depends on the other
  lanes or columns. On the gather + SDPA path (no paged kernel) lanes with equal spans share a
  call. With
  the fused kernels (CUDA) a verify pass's GDN columns are one launch of
  :func:`hpc_kernels.gdn_decode.gdn_step` over all lanes, one program per lane, value head and
  block of value columns stepping its state column by column in registers (each column the
  code and numbers of a one-column launch); decode
  runs the same step after a conv launch that steps the conv states in their slots
  (:func:`hpc_kernels.gdn_decode.gdn_decode_step`), the same sums in the same order.
* **One row block, split sums.** Where the pass is one row block (decode, a short verify), the
  attention, GDN and MLP output products leave their K splits' partial sums
  (:mod:`hpc_kernels.split_sums`) and the norm that adds the residual adds them, in decode and
  verify alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hpc_cli.model.moe import SparseMoE

from hpc_cli.model.gdn import gated_delta_decode, recurrent_rule
from hpc_cli.model.layers import fused
from hpc_kernels import gdn_decode
from hpc_kernels.split_sums import SplitSums, summed

#: rows per block of the row-wise ops by device type (``HybridModel.row_block`` overrides it): on
#: a GPU a GEMM of 16 rows costs what one of 1 row costs (memory-bound) and covers 4 lanes x k+1
#: = 4 columns in one block; on CPU bf16 GEMMs grow with the rows, and 4 keeps decode's speed
ROW_BLOCK = {"cuda": 16, "cpu": 4}


#: table entries (the lanes' tables and, past one column, each row's) up to which
#: :meth:`ColumnIndex.pack_values` builds the index in plain Python: beyond about a thousand,
#: numpy's list of values goes into a staged buffer faster than Python's (measured with the
#: buffer's fill on the 2-core CPU machine: 23 against 35 us at 8 lanes of 64 pages, 37 against 32
#: at 4 lanes, 4 columns and 64 pages, 247 against 84 at 16 lanes, 4 columns and 128 pages)
SMALL_INDEX = 1024


def row_block(model) -> int:
    return int(getattr(model, "row_block", None) or ROW_BLOCK.get(model.device.type, 16))


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    pad = n - x.shape[0]
    return x if pad == 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


def blocks(fn: Callable, R: int, *xs: torch.Tensor):
    """``fn`` over row blocks of exactly ``R`` rows of ``xs`` (all padded to a multiple of ``R``)."""
    n = xs[0].shape[0]
    if n == R:
        return fn(*xs)
    parts = [fn(*(x[i:i + R] for x in xs)) for i in range(0, n, R)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def _groups(tables: Sequence[Sequence[int]], positions: Sequence[int], page: int) -> list[tuple[tuple[int, ...], int]]:
    """Lanes grouped by their own key span: ``(lane indices, pages read)``, fewest pages first. A
    lane reads exactly its own pages up to its position, never a span widened by other lanes."""
    by: dict[int, list[int]] = {}
    for b, (p, bt) in enumerate(zip(positions, tables)):
        n = p // page + 1
        assert len(bt) >= n, f"block table has {len(bt)} pages, position {p} needs {n}"
        by.setdefault(n, []).append(b)
    return [(tuple(lanes), n) for n, lanes in sorted(by.items())]


def graph_width(pages: int) -> int:
    """``pages`` rounded up to a power of two (>= 8): the page-table widths of the decode and
    verify graphs, so the warm-up compiles the paged decode kernel for every width it meets."""
    return max(8, 1 << (max(pages, 1) - 1).bit_length())


def table_width(tables: Sequence[Sequence[int]], starts: Sequence[int], T: int, page: int) -> int:
    """Pages the widest lane needs for its last column, rounded up (:func:`graph_width`), so CUDA
    graphs keyed by the width serve many context lengths."""
    return graph_width(max(max((s + T - 1) // page + 1 for s in starts), max(len(t) for t in tables), 1))


@dataclass
class ColumnIndex:
    """Every index a column pass reads, built once per pass (not per layer) and moved to the device
    in ONE copy: rows are ``b * T + t``, lane-major.

    ``tokens``/``positions`` ``[B*T]``, ``slots`` ``[B]`` state slots, ``write`` ``[B, T]`` the KV slot
    of column ``t`` of lane ``b``, ``seqlens`` ``[B, T]`` keys column ``t`` reads, ``tables``
    ``[B, W]`` page tables (padded with page 0, never read past ``seqlens``), ``row_tables`` ``[B*T, W]`` each row's (its lane's; ``tables`` itself for one
    column). ``host`` keeps the lists for the gather + SDPA attention path."""

    B: int
    T: int
    W: int
    packed: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    write: torch.Tensor
    seqlens: torch.Tensor
    tables: torch.Tensor
    row_tables: torch.Tensor
    host: tuple | None = None
    #: the draft columns ``1..T-1`` of ``tokens`` as ``[B, T - 1]`` (a view, made once: a
    #: round's :meth:`put_drafts` writes it), None for one column
    draft_columns: torch.Tensor | None = None

    @staticmethod
    def pack(tokens: torch.Tensor | Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[Sequence[int]],
             slots: Sequence[int], page: int, W: int, rope_offsets: Sequence[int] | None = None) -> torch.Tensor:
        """The int64 host buffer :meth:`view` reads (one H2D copy): :meth:`pack_values` as a tensor."""
        values = ColumnIndex.pack_values(tokens, starts, tables, slots, page, W, rope_offsets)
        return torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)

    @staticmethod
    def pack_values(tokens: torch.Tensor | Sequence[Sequence[int]], starts: Sequence[int],
                    tables: Sequence[Sequence[int]], slots: Sequence[int], page: int, W: int,
                    rope_offsets: Sequence[int] | None = None) -> list[int] | np.ndarray:
        """The values of the packed buffer, in :meth:`view`'s order (``tokens`` ``[B, T]``, a tensor
        or rows). ``rope_offsets``: per lane, what its rotary positions add to its token positions
        (a Vision prompt's mRoPE delta). A decode step or a speculative round waits for them: a
        small index (table entries up to :data:`SMALL_INDEX`) is built in plain Python (on the
        2-core CPU machine 7 us staged at one lane and two columns, where numpy's dozen calls take
        23 us), a large one in numpy."""
        rows_ = tokens.tolist() if torch.is_tensor(tokens) else tokens
        B, T = len(rows_), len(rows_[0])
        for b, bt in enumerate(tables):
            need = (starts[b] + T - 1) // page + 1
            assert len(bt) >= need, f"block table has {len(bt)} pages, position {starts[b] + T - 1} needs {need}"
        if B * W * (T + 1 if T > 1 else 1) > SMALL_INDEX:
            return ColumnIndex._pack_numpy(rows_, starts, tables, slots, page, W, rope_offsets)
        cols = range(T)
        out = [t for row in rows_ for t in row]
        if rope_offsets is None:
            out += [s + t for s in starts for t in cols]
        else:
            out += [s + o + t for s, o in zip(starts, rope_offsets) for t in cols]
        out += slots
        tab = [list(bt[:W]) + [0] * (W - min(len(bt), W)) for bt in tables]
        out += [tab[b][(s + t) // page] * page + (s + t) % page for b, s in enumerate(starts) for t in cols]
        out += [s + t + 1 for s in starts for t in cols]
        for row in tab:
            out += row
        if T > 1:  # each row's table: its lane's
            for row in tab:
                for _ in cols:
                    out += row
        return out

    @staticmethod
    def _pack_numpy(tokens: Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[Sequence[int]],
                    slots: Sequence[int], page: int, W: int, rope_offsets: Sequence[int] | None) -> np.ndarray:
        B, T = len(tokens), len(tokens[0])
        t = np.arange(T, dtype=np.int64)
        pos = np.asarray(starts, dtype=np.int64)[:, None] + t[None, :]  # [B, T]
        rope = pos if rope_offsets is None else pos + np.asarray(rope_offsets, dtype=np.int64)[:, None]
        tab = np.zeros((B, W), dtype=np.int64)
        for b, bt in enumerate(tables):
            k = min(len(bt), W)
            tab[b, :k] = bt[:k]
        write = np.take_along_axis(tab, pos // page, axis=1) * page + pos % page  # [B, T]
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        parts = [tok, rope.reshape(-1), np.asarray(slots, dtype=np.int64), write.reshape(-1), (pos + 1).reshape(-1),
                 tab.reshape(-1)]
        if T > 1:
            parts.append(np.repeat(tab, T, axis=0).reshape(-1))
        return np.concatenate(parts)

    @classmethod
    def view(cls, packed: torch.Tensor, B: int, T: int, W: int, host: tuple | None = None) -> "ColumnIndex":
        n = B * T
        parts = torch.split(packed, [n, n, B, n, n, B * W] + ([n * W] if T > 1 else []))
        tables = parts[5].view(B, W)
        return cls(B, T, W, packed, parts[0], parts[1], parts[2], parts[3].view(B, T), parts[4].view(B, T),
                   tables, parts[6].view(n, W) if T > 1 else tables, host,
                   parts[0].view(B, T)[:, 1:] if T > 1 else None)

    @staticmethod
    def lanes_of(B: int, T: int, W: int) -> list[int]:
        """The lane each value of a packed buffer of ``B`` lanes x ``T`` columns x ``W`` pages
        belongs to, in :meth:`view`'s order (for :meth:`choose`)."""
        per_column = [i // T for i in range(B * T)]
        lanes = per_column * 2 + list(range(B)) + per_column * 2 + [i // W for i in range(B * W)]
        if T > 1:
            lanes += [i // (T * W) for i in range(B * T * W)]
        return lanes

    def choose(self, variants: torch.Tensor, counts: torch.Tensor, lanes_of: torch.Tensor) -> None:
        """This index from ``variants`` ``[C, L]`` (packed buffers of this shape, on the device):
        each lane's values from variant ``counts[b]`` (``lanes_of``: :meth:`lanes_of` on the
        device). Device values only, no host read."""
        self.packed.copy_(variants.gather(0, counts.index_select(0, lanes_of)[None])[0])

    def put_drafts(self, drafts: torch.Tensor) -> None:
        """Columns ``1..T-1`` of the tokens from ``drafts`` ``[B, T - 1]`` on the device (one
        device copy into the packed buffer, no read by the host)."""
        assert self.draft_columns is not None and drafts.shape == self.draft_columns.shape, \
            f"drafts {tuple(drafts.shape)} for {self.B} x {self.T} columns"
        self.draft_columns.copy_(drafts, non_blocking=True)

    @classmethod
    def build(cls, tokens: torch.Tensor, starts: Sequence[int], tables: Sequence[Sequence[int]],
              slots: Sequence[int], page: int, device: torch.device,
              rope_offsets: Sequence[int] | None = None) -> "ColumnIndex":
        B, T = tokens.shape
        W = table_width(tables, starts, T, page)
        packed = cls.pack(tokens, starts, tables, slots, page, W, rope_offsets)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        return cls.view(packed, B, T, W, (list(starts), [list(t) for t in tables]))


@dataclass
class ColumnsOut:
    logits: torch.Tensor  # [B, T, vocab]
    hidden: torch.Tensor  # [B, T, hidden] after the final norm
    features: torch.Tensor | None  # [B, T, len(capture) * hidden]
    windows: list[torch.Tensor] | None  # per GDN layer [B, C, K-1+T] (keep_all)
    states: list[torch.Tensor] | None  # per GDN layer [B, T, H, dk, dv] (keep_all)
    #: the device index the pass read (a graph's static one: its tokens, write slots, lengths)
    index: ColumnIndex | None = None
    #: the serial number of the CUDA graph whose static outputs these are (valid until its next
    #: replay; a graph captured again gets a new one), 0 for a pass's own tensors
    static: int = 0
    #: a verify pass's (``keep_all``, two or more columns) ``[B, 2T - 1]``: the tokens of columns
    #: ``1..T-1`` (the drafts) and every column's argmax, computed in the pass (its graph) so that
    #: the host reads drafts and verdicts in one copy
    verdict: torch.Tensor | None = None
    #: a verify pass's ``windows`` and ``states`` as two stacked tensors ``[G, B, C, K-1+T]`` and
    #: ``[G, B*T, H, dk, dv]`` (the lists are views of them); None without GDN layers
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None


class _Stacks:
    """A verify pass's kept windows and states of every GDN layer in two stacked tensors
    (``[G, B, C, K-1+T]`` and ``[G, B*T, H, dk, dv]``, allocated at the first layer), so that a
    round's commit copies every layer's in one launch each (:func:`hpc_cli.speculative.ops.commit_columns`)
    instead of a few launches a layer. Both GDN paths (the fused kernels', torch's) fill them."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.windows: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None
        self.filled = 0

    def window(self, g: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if self.windows is None:
            self.windows = like.new_empty(self.layers, *shape)
        self.filled += 1
        return self.windows[g]

    def kept_rows(self, g: int, rows: int, rec: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            self.kept = rec.new_empty(self.layers, rows, *rec.shape[1:])
        return self.kept[g]

    def both(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The two stacks where every layer filled its part, else None (the per-layer tensors)."""
        return (self.windows, self.kept) if self.filled == self.layers and self.kept is not None else None


def _gdn(la, h: torch.Tensor, n: int, B: int, T: int, conv: torch.Tensor, rec: torch.Tensor,
         slot_t: torch.Tensor, keep_all: bool, R: int, run: int | None = None, unsummed: bool = False,
         stacks: tuple[_Stacks, int] | None = None):
    """The GDN layer's columns. ``conv`` and ``rec`` are the layer's conv and recurrent state
    slots, the lanes' in ``slot_t`` (the conv states are only read; each lane's window comes back
    ``[B, C, K-1+T]``). ``rec``: with
    ``keep_all`` they are read only (every column's state comes back ``[B, T, H, dk, dv]``), else
    the last column's state is written back there (and ``None`` comes back). ``run``: the first of
    the lanes' slots where they are consecutive (:func:`_slot_run`; decode on the CPU only).
    ``unsummed``: the output projection's split sums where it has them (one row block).
    ``stacks``: where a verify pass (``keep_all``) keeps this layer's window and states (and the
    layer's place there)."""
    assert stacks is not None or not keep_all, "a verify pass keeps its windows and states stacked"
    finish = functools.partial(la._finish, unsummed=unsummed)
    mixed, z, b, a = blocks(la._project, R, h)
    C = mixed.shape[-1]
    m = mixed[:n].view(B, T, C)
    if _fused_gdn(la, h):
        # the lanes' conv states and the columns' projections, in one launch ([B, C, K-1+T])
        shape = (B, C, conv.shape[-1] + T)
        if keep_all:
            st, at = stacks
            window, kept = st.window(at, shape, m), st.kept_rows(at, B * T, rec)
        else:
            window, kept = m.new_empty(shape), None
        gdn_decode.conv_window(conv, slot_t, mixed[:n], T, window)
        core, state = _gdn_fused(la, window, a, b, B, T, rec, slot_t, keep_all, h.shape[0], kept)
        return blocks(finish, R, core, z), window, state
    parts = [conv.index_select(0, slot_t).to(m.dtype), m.transpose(1, 2)]
    if keep_all:
        st, at = stacks
        window = torch.cat(parts, dim=-1, out=st.window(at, (B, C, conv.shape[-1] + T), m))  # [B, C, K-1+T]
    else:
        window = torch.cat(parts, dim=-1)
    w = la.conv1d.weight[:, 0, :]  # [C, K]
    K = w.shape[-1]
    b3, a3 = b[:n].view(B, T, -1), a[:n].view(B, T, -1)
    # ``run`` (decode on the CPU, the lanes' slots one run starting there): the states are stepped
    # where they lie in ``rec`` (fp32 slots), not gathered, copied by the rule and scattered back
    # (three copies of the state a layer, 3 MiB each at the 27B mixer widths); the same arithmetic,
    # the same bits
    state = rec.narrow(0, run, B) if run is not None else rec.index_select(0, slot_t)
    # a verify pass (keep_all, several columns) on the CPU steps its columns in one call of the
    # rule, which keeps every column's state: the rule's preparation (head repeats, transposes,
    # norms) runs once for the columns, each step on decode's operands (recurrent_rule)
    together = keep_all and T > 1 and not h.is_cuda
    outs, states, heads = [], [], []
    for t in range(T):
        # decode's exact calls on contiguous [B, ...] operands: on CPU even an elementwise op
        # (softplus, exp, silu) rounds differently in its vector body and its scalar tail, so the
        # operands of column t must have decode's shapes and layout, not be slices of [B, T, ...]
        conv = (window[:, :, t:t + K].contiguous().to(w.dtype) * w).sum(-1)  # [B, C]
        mixed_t = F.silu(conv).to(m.dtype)
        q, k, v, g, beta = la._heads(mixed_t, b3[:, t].contiguous(), a3[:, t].contiguous(), (B, 1))
        if together:
            heads.append((q, k, v, g.view(B, 1, -1), beta.view(B, 1, -1)))
            continue
        o, state = gated_delta_decode(q, k, v, g.view(B, 1, -1), beta.view(B, 1, -1), state, la.use_fla,
                                      in_place=run is not None)
        outs.append(o)
        if keep_all:
            states.append(state)
    kept = st.kept_rows(at, B * T, rec).view(B, T, *rec.shape[1:]) if keep_all else None
    if together:
        o, _ = recurrent_rule(*(torch.cat(x, dim=1) for x in zip(*heads)), state,
                              in_place=state.dtype == torch.float32, keep=kept)
    else:
        o = torch.cat(outs, dim=1)
    core = o.reshape(n, *o.shape[2:])  # rows b*T + t
    core = _pad_rows(core, h.shape[0])
    out = blocks(finish, R, core, z)
    if keep_all:
        return out, window, kept if together else torch.stack(states, dim=1, out=kept)
    if run is None:
        rec.index_copy_(0, slot_t, state)
    return out, window, None


def _fused_gdn(la, h: torch.Tensor) -> bool:
    """Whether the GDN layer ``la``'s columns run :mod:`hpc_kernels.gdn_decode` (CUDA, or Triton's
    interpreter), not torch's ops."""
    return fused(h) and la.use_fla is not False and gdn_decode.supported(la.d_k, la.d_v)


def _gdn_decode(la, h: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, slot_t: torch.Tensor, R: int,
                unsummed: bool) -> "torch.Tensor | SplitSums":
    """Decode's GDN layer (one column a lane) with the fused kernels: the lanes' conv and
    recurrent states stepped in their slots by :func:`hpc_kernels.gdn_decode.gdn_decode_step`
    (no window gathered, concatenated and scattered back), the rows past the lanes zero. The
    numbers of :func:`_gdn_fused` on the window, bit for bit (the verify pass's)."""
    mixed, z, b, a = blocks(la._project, R, h)
    o = mixed.new_empty(h.shape[0], la.n_v, la.d_v)
    gdn_decode.gdn_decode_step(mixed, conv, slot_t, la.conv1d.weight[:, 0, :], a, b, la.A_log, la.dt_bias, rec,
                               la.n_k, o)
    return blocks(functools.partial(la._finish, unsummed=unsummed), R, o, z)


def _slot_run(slot_t: torch.Tensor) -> int | None:
    """The first slot where ``slot_t`` (on the CPU: a host read) is consecutive slots in order, else
    None; None on other devices."""
    if slot_t.device.type != "cpu":
        return None
    slots = slot_t.tolist()
    return slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None


def _gdn_fused(la, window: torch.Tensor, a: torch.Tensor, b: torch.Tensor, B: int, T: int, rec: torch.Tensor,
               slot_t: torch.Tensor, keep_all: bool, rows: int, kept: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The columns through :func:`hpc_kernels.gdn_decode.gdn_step`, all ``T`` in one launch (each
    program steps its state block column by column in registers: a column's numbers are those of
    a launch of its own), output rows ``b * T + t`` of ``rows`` (the pass's padded rows, which
    the launch zeros): decode steps the lanes' slots in place; the verify pass (``keep_all``)
    writes column ``t``'s state to row ``b * T + t`` of a ``[B * T, ...]`` buffer (``kept``, else
    a new one)."""
    o = window.new_empty(rows, la.n_v, la.d_v)
    w = la.conv1d.weight[:, 0, :].contiguous()
    if not keep_all:
        gdn_decode.gdn_step(window, 0, w, a, b, la.A_log, la.dt_bias, rec, slot_t, rec, slot_t, la.n_k, T, o, columns=T)
        return o, None
    if kept is None:
        kept = rec.new_empty(B * T, *rec.shape[1:])
    gdn_decode.gdn_step(window, 0, w, a, b, la.A_log, la.dt_bias, rec, slot_t, kept, None, la.n_k, T, o, columns=T)
    return o, kept.view(B, T, *rec.shape[1:])


class _GroupKV:
    """The gathered K/V of one layer for a lane group and span (pages), built the way decode
    builds it (one gather of the group's pages, ``[G, H_kv, S, d]``) and reused by every column of
    the pass that reads that group and span: decode and verify feed attention identical
    tensors, while a verify pass gathers once per layer instead of once per column."""

    def __init__(self, attn, kv, layer: int, tables: Sequence[Sequence[int]], dtype: torch.dtype) -> None:
        self.attn, self.kv, self.layer, self.tables, self.dtype = attn, kv, layer, tables, dtype
        self.held: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, lanes: tuple[int, ...], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (lanes, width)
        if key not in self.held:
            attn, page = self.attn, self.kv.page_tokens
            G, span = len(lanes), width * page
            pages = torch.tensor([self.tables[b][i] for b in lanes for i in range(width)], dtype=torch.long,
                                 device=device)
            keys, values = self.kv.gather(self.layer, pages, G * span, self.dtype)
            keys = keys.view(G, span, attn.n_kv, attn.head_dim).transpose(1, 2)
            values = values.view(G, span, attn.n_kv, attn.head_dim).transpose(1, 2)
            self.held[key] = (keys, values)
        return self.held[key]


def _attention(attn, h, idx: ColumnIndex, kv, layer: int, cos, sin, R: int, paged: bool, unsummed: bool):
    """``paged``: read the pages with the paged decode kernel (else gather + SDPA per span group);
    ``unsummed``: the output projection's split sums where it has them (one row block)."""
    finish = functools.partial(attn.finish, unsummed=unsummed)
    q, gate, k, v = blocks(attn.qkv, R, h, cos, sin)
    # every column's K/V written first: a column reads keys up to its own position only, so the
    # later columns' K/V sit in masked slots exactly where decode has stale ones (a masked key adds
    # exp(-inf) * v = 0 either way)
    n = idx.B * idx.T
    kv.write(layer, idx.write.reshape(-1), k[:n], v[:n])
    if paged:
        # every column's query in ONE launch of the paged decode kernel: it runs a program per
        # row, KV head and split whatever the rows, so a column's result is what decode's
        # one-column launch computes
        # (the rows past the lanes' come back zero from the same launch: no padding of its own)
        o = kv.decode_attention(layer, q[:n], idx.row_tables, idx.seqlens.reshape(-1), attn.scale, q.shape[0])
        return blocks(finish, R, o, gate)
    o_rows = q.new_zeros(q.shape)
    starts, tables = idx.host
    gathered = _GroupKV(attn, kv, layer, tables, q.dtype)
    page, dev = kv.page_tokens, h.device
    for t in range(idx.T):
        positions = [s + t for s in starts]
        for lanes, width in _groups(tables, positions, page):
            span = width * page
            keys, values = gathered.get(lanes, width, dev)
            pos = torch.tensor([positions[b] for b in lanes], dtype=torch.long, device=dev)
            mask = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None]
            sel_rows = torch.tensor([b * idx.T + t for b in lanes], dtype=torch.long, device=dev)
            o_rows.index_copy_(0, sel_rows, attn.attend_one(q.index_select(0, sel_rows), keys, values, mask))
    return blocks(finish, R, o_rows, gate)


def columns_pass(model, tokens: torch.Tensor, starts: Sequence[int], tables: Sequence[Sequence[int]],
                 slots: Sequence[int], kv, states, *, keep_all: bool, capture: Sequence[int] = (),
                 logits: bool = True, rope_offsets: Sequence[int] | None = None,
                 drafts: torch.Tensor | None = None) -> ColumnsOut:
    """Score ``tokens`` ``[B, T]`` at ``starts[b] + t``. With ``keep_all`` the slots are left
    untouched and the conv windows and recurrent states after every column come back; without it
    the state after the last column (and the last hidden) is written to each lane's slot.
    ``rope_offsets[b]`` is added to lane ``b``'s rotary positions (a Vision prompt's mRoPE delta).
    ``drafts`` ``[B, T - 1]`` on the device: columns ``1..T-1`` of the tokens, read there (a
    drafter's proposal that the host has not read; ``tokens`` holds placeholders there)."""
    B, T = tokens.shape
    assert len(starts) == len(tables) == len(slots) == B, "one start, block table and state slot per lane"
    assert len(set(slots)) == B, f"lanes share a state slot: {list(slots)}"
    idx = ColumnIndex.build(tokens, starts, tables, slots, kv.page_tokens, model.device, rope_offsets)
    if drafts is not None:
        idx.put_drafts(drafts)
    return columns_core(model, idx, kv, states, keep_all=keep_all, capture=capture, logits=logits)


def columns_core(model, idx: ColumnIndex, kv, states, *, keep_all: bool, capture: Sequence[int] = (),
                 logits: bool = True) -> ColumnsOut:
    """The column pass over device indices only: no host reads, no shapes that depend on values,
    so it can be captured in a CUDA graph (:mod:`hpc_cli.model.graphs`)."""
    B, T = idx.B, idx.T
    R = row_block(model)
    n = B * T
    n_pad = -(-n // R) * R
    slot_t = idx.slots
    flat_pos = _pad_rows(idx.positions, n_pad)
    flat_tok = _pad_rows(idx.tokens, n_pad)
    cos, sin = blocks(lambda p: model.rotary.cos_sin(p, model.dtype), R, flat_pos)
    x = blocks(model._embed, R, flat_tok)
    capture = set(capture)
    paged = kv.paged_attention_supported(model.config.num_attention_heads)
    run = None if keep_all else _slot_run(slot_t)  # once a pass: every GDN layer's slots are the same
    feats, windows, kept = [], [], []
    stacks = _Stacks(states.num_gdn_layers) if keep_all else None
    pending = None  # the last MLP's output, added to x by the next norm (one launch for both)
    # one row block (decode, a short verify): the attention, GDN and MLP outputs that the next
    # norm adds may stay their products' split sums, which that norm's launch adds
    one = n_pad == R
    for i, layer in enumerate(model.layers):
        if pending is None:
            h = blocks(layer.input_layernorm, R, x)
        else:
            x, h = blocks(layer.input_layernorm.add, R, x, pending)
            pending = None
        if layer.kind == "linear_attention":
            g = model.state_index[i]
            conv, rec = states.conv[g], states.recurrent[g]
            la = layer.linear_attn
            if not keep_all and T == 1 and _fused_gdn(la, h):
                out = _gdn_decode(la, h, conv, rec, slot_t, R, one)  # both states stepped in their slots
            else:
                out, window, st = _gdn(la, h, n, B, T, conv, rec, slot_t, keep_all, R, run,
                                       one, (stacks, g) if stacks is not None else None)
                if keep_all:
                    windows.append(window)
                    kept.append(st)
                else:
                    K1 = conv.shape[-1]
                    conv.index_copy_(0, slot_t, window[:, :, -K1:].to(conv.dtype))
        else:
            out = _attention(layer.self_attn, h, idx, kv, model.kv_index[i], cos, sin, R, paged, one)

        if isinstance(layer.mlp, SparseMoE):
            # Routing depends on which tokens share a call, so the MoE is not row-blocked (MoE has
            # no bit-identity claim) and padded rows never reach the router: routing traces, hit
            # rates and host bytes per token count real tokens only.
            x, normed = blocks(layer.post_attention_layernorm.add, R, x, out)
            x = torch.cat([x[:n] + layer.mlp(normed[:n]), x[n:]])
        else:
            def tail(xb, ob, layer=layer):
                xb, normed = layer.post_attention_layernorm.add(xb, ob)
                return xb, layer.mlp(normed, unsummed=one)

            x, pending = blocks(tail, R, x, out)
        if i in capture:  # the layer's output itself
            if pending is not None:
                x, pending = blocks(torch.add, R, x, summed(pending)), None
            feats.append(x[:n])
    if pending is None:
        xn = blocks(model.norm, R, x)
    else:
        _, xn = blocks(model.norm.add, R, x, pending)
    hidden = xn[:n].view(B, T, -1)
    if not keep_all:
        states.hidden.index_copy_(0, slot_t, hidden[:, -1].to(states.hidden.dtype))
    lg = blocks(model.lm_head, R, xn)[:n].view(B, T, -1) if logits else None
    verdict = (torch.cat([idx.tokens.view(B, T)[:, 1:], lg.argmax(-1)], 1)
               if keep_all and T > 1 and lg is not None else None)
    return ColumnsOut(lg, hidden, torch.cat(feats, dim=-1).view(B, T, -1) if feats else None,
                      windows if keep_all else None, kept if keep_all else None, index=idx, verdict=verdict,
                      stacked=stacks.both() if stacks is not None else None)
