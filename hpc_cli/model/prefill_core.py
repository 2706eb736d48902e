"""The prefill pass over device indices only, so that it can be captured in a CUDA graph.

:meth:`hpc_cli.model.model.HybridModel.prefill` takes host values (the start position, the valid
row count, the state slot, the block table) and bakes them into its shapes and kernel arguments;
launched op by op from Python, a pass of a few hundred tokens then costs more host time than
device time (hundreds of launches, fla's Python wrappers). :func:`prefill_core` computes the same
pass from one packed int64 index (:class:`PrefillIndex`) that a single host-to-device copy fills:

* the ``L`` rows (the pass padded to a multiple of 64) have their tokens, positions and KV write
  slots in the index (padding rows write nowhere: slot ``-1``);
* the paged prefill kernel reads ``start`` and the valid row count from the index
  (``hpc_kernels/paged_prefill.py``, ``meta``), and the page table is a fixed-width row of it;
* the GDN layers take their padding mask and the new conv window's columns from it
  (:class:`hpc_cli.model.gdn.ValidRows`), and read and write the lane's state slot by index;
* the last valid row's hidden and logits are picked by index.

So the shapes depend on ``L`` and the table width only, and one graph per ``(L, width)`` serves
every pass (:mod:`hpc_cli.model.prefill_graphs`). The values are those of ``HybridModel.prefill``
with the same padding: the same kernels on the same shapes, the padding rows masked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from hpc_cli.model.gdn import ValidRows
from hpc_cli.model.gdn_taps import fla_taps_supported

if TYPE_CHECKING:
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.memory.state_pool import StateSlots
    from hpc_cli.model.model import HybridModel

#: the narrowest page table a pass's index carries: a power of two >= the pages the pass reads, so
#: one graph per length serves every context up to 512 pages (32k tokens)
MIN_TABLE_WIDTH = 512


def table_width(n_pages: int) -> int:
    return max(MIN_TABLE_WIDTH, 1 << max(0, n_pages - 1).bit_length())


@dataclass
class PrefillIndex:
    """Every index a prefill pass reads, in one int64 buffer ``packed`` (one host-to-device copy).

    ``tokens``/``positions``/``write`` ``[L]`` (``write``: the KV slot of each row, ``-1`` for a
    padding row), ``pages`` ``[W]`` the lane's page table (padded with page 0, never read past the
    pass's last position), ``meta`` ``[2]`` (start, valid rows) for the paged prefill kernel,
    ``image_slots`` ``[1 + slots]`` the lane's state slot (``slot``), then the slot each tap's
    image goes to, ``kept_rows`` ``[1 + slots]`` the last valid row, then the row whose hidden
    each tap keeps, ``conv_index``
    ``[kernel-1]`` the window columns of the new conv state. ``host``: (start, valid) for the
    paths that read host values (the gather + SDPA attention).

    A pass with room for ``slots`` taps (the zero-split tap, :mod:`hpc_cli.model.gdn_taps`) also
    carries ``conv_cols`` ``[(1 + slots) * (kernel-1)]`` (``conv_index``, then each
    tap's conv window columns: one gather and one ``index_copy_`` per GDN layer take and write
    every conv window) and ``tap_pos`` ``[slots]`` (each tap's offset in the pass, in order; the
    row before it is the tap's entry of ``kept_rows``). A slot not used holds
    offset 0, the lane's state slot and the lane's own conv columns and last row: what the pass
    writes there for it is the lane's own image, bit for bit, so a repeated index writes equal
    values in any order.
    """

    L: int
    W: int
    packed: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    pages: torch.Tensor
    meta: torch.Tensor
    image_slots: torch.Tensor  # [1 + slots]: the lane's state slot, then each tap's
    kept_rows: torch.Tensor  # [1 + slots]: the rows whose hidden goes to image_slots, in order
    conv_index: torch.Tensor
    host: tuple[int, int] | None = None
    slots: int = 0
    conv_cols: torch.Tensor | None = None
    tap_pos: torch.Tensor | None = None

    @property
    def slot(self) -> torch.Tensor:
        """``[1]``: the lane's state slot."""
        return self.image_slots[:1]

    @staticmethod
    def pack(tokens: Sequence[int] | torch.Tensor, start: int, block_table: Sequence[int], state_slot: int,
             L: int, W: int, page: int, conv_taps: int, taps: Sequence[tuple[int, int]] = (),
             slots: int = 0) -> torch.Tensor:
        """The host buffer :meth:`view` reads; ``tokens`` are the pass's valid tokens (``<= L``),
        ``taps`` ``(offset inside the pass, state slot)`` pairs (at most ``slots``). Built in numpy
        (the pass waits for it: the same in torch CPU ops took 260-530 us)."""
        if torch.is_tensor(tokens):
            tok = tokens.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        else:
            tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = tok.shape[0]
        assert 1 <= n <= L, f"a pass of {n} tokens does not fit {L} rows"
        n_pages = (start + n + page - 1) // page
        assert len(block_table) >= n_pages, \
            f"block table has {len(block_table)} pages, positions [0, {start + n}) need {n_pages}"
        assert n_pages <= W, f"{n_pages} pages do not fit a table of {W}"
        pos = start + np.arange(L, dtype=np.int64)
        pages = np.zeros(W, dtype=np.int64)
        pages[:n_pages] = block_table[:n_pages]
        write = pages[np.minimum(pos // page, W - 1)] * page + pos % page
        write[n:] = -1
        padded = np.zeros(L, dtype=np.int64)
        padded[:n] = tok
        ar = np.arange(conv_taps, dtype=np.int64)
        conv = n + ar
        at: list[int] = []
        dst: list[int] = []
        if slots:
            at = [p for p, _ in taps]
            dst = [d for _, d in taps]
            assert len(at) <= slots, f"{len(at)} taps do not fit {slots} slots"
            assert all(0 < p < n for p in at) and at == sorted(set(at)), f"taps {at} not sorted inside (0, {n})"
            assert state_slot not in dst and len(set(dst)) == len(dst), f"tap slots {dst} (the lane's is {state_slot})"
        else:
            assert not taps, "a pass with taps needs tap slots"
        free = slots - len(at)
        # a slot not used: offset 0 (no state written), the lane's slot, its conv columns and last row
        cols = [conv] + [p + ar for p in at] + [conv] * free
        # the last row and the taps' rows side by side, in the order of image_slots: the rows
        # whose hidden the lane's slot and the taps' slots keep are one view
        parts = [padded, pos, write, pages,
                 np.array([start, n, state_slot, *dst, *([state_slot] * free), n - 1], dtype=np.int64),
                 np.array([*(p - 1 for p in at), *([n - 1] * free)], dtype=np.int64),
                 np.concatenate(cols), np.array([*at, *([0] * free)], dtype=np.int64)]
        return torch.from_numpy(np.concatenate(parts))

    @classmethod
    def view(cls, packed: torch.Tensor, L: int, W: int, host: tuple[int, int] | None = None,
             slots: int = 0) -> "PrefillIndex":
        # the conv columns: k1 of the lane's, then k1 per tap slot
        k1 = (packed.shape[0] - (3 * L + W + 4) - 3 * slots) // (1 + slots)
        tokens, positions, write, pages, meta, image_slots, kept_rows, conv_all, tap_pos = torch.split(
            packed, [L, L, L, W, 2, 1 + slots, 1 + slots, k1 * (1 + slots), slots])
        idx = cls(L, W, packed, tokens, positions, write, pages, meta, image_slots, kept_rows, conv_all[:k1], host)
        if slots:
            idx.slots = slots
            idx.conv_cols = conv_all
            idx.tap_pos = tap_pos
        return idx

    @classmethod
    def build(cls, model: "HybridModel", tokens, start: int, block_table: Sequence[int], state_slot: int,
              L: int, page: int, taps: Sequence[tuple[int, int]] = (), slots: int = 0) -> "PrefillIndex":
        n = len(tokens)
        W = table_width((start + n + page - 1) // page)
        packed = cls.pack(tokens, start, block_table, state_slot, L, W, page, model.config.linear_conv_kernel_dim - 1,
                          taps, slots)
        if model.device.type == "cuda":
            packed = packed.pin_memory().to(model.device, non_blocking=True)
        return cls.view(packed.to(model.device), L, W, host=(start, n), slots=slots)


@dataclass
class PrefillCoreOut:
    logits: torch.Tensor  # [vocab] of the last valid row
    hidden_last: torch.Tensor  # [hidden] after the final norm
    #: ``[rows, hidden]`` after the final norm, every row (``hidden_out``: a speculative backend's)
    hidden: torch.Tensor | None = None
    #: ``[rows, len(capture) * hidden]``: the residual stream after each captured layer (DFlash)
    features: torch.Tensor | None = None


def prefill_core(model: "HybridModel", idx: PrefillIndex, kv: "PagedKVStorage",
                 states: "StateSlots", *, hidden_out: torch.Tensor | None = None,
                 features_out: torch.Tensor | None = None, capture: Sequence[int] = ()) -> PrefillCoreOut:
    """One lane's prefill pass of ``idx.L`` rows (the valid ones first) from device indices only.
    Reads the pages through the paged prefill kernel where the pool allows (else gathers them with
    the host values in ``idx.host``); writes K/V, the lane's GDN states and its hidden. With tap
    slots (``idx.slots``) the pass also writes its taps' images into their state slots (no split).
    What a speculative backend reads of the pass goes into tensors the caller owns (a graph's
    shared buffers): ``hidden_out`` ``[L, hidden]`` every row's hidden after the final norm, and
    ``features_out`` ``[L, len(capture) * hidden]`` the residual stream after each layer of
    ``capture``, in layer order."""
    from hpc_cli.model.attention import prefill_attention

    L = idx.L
    dev = model.device
    mask = torch.arange(L, device=dev) < idx.meta[1]
    # a pass with tap slots gathers its taps' conv windows with the new conv state
    rows = ValidRows(mask, idx.conv_index if not idx.slots else idx.conv_cols)
    # the GDN layers read and write the lane's state slot in place where the tap recurrence runs
    # (CUDA with fla's kernels; every pass with tap slots)
    in_slots = bool(idx.slots) or (dev.type == "cuda" and fla_taps_supported(model.config.linear_key_head_dim))
    tap_pos = idx.tap_pos if idx.slots else torch.zeros(0, dtype=torch.long, device=dev)
    cos, sin = model.rotary.cos_sin(idx.positions, model.dtype)
    paged = kv.paged_attention_supported(model.config.num_attention_heads)
    x = model._embed(idx.tokens)
    slot = idx.slot
    captured = sorted(set(capture)) if features_out is not None else []
    width = features_out.shape[-1] // max(1, len(captured)) if captured else 0
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        if layer.kind == "linear_attention":
            g = model.state_index[i]
            conv, rec = states.conv[g], states.recurrent[g]
            if in_slots:
                out = layer.linear_attn.prefill_slots(h, conv, rec, rows, tap_pos, idx.image_slots)
            else:
                out, new_conv, new_rec = layer.linear_attn.prefill(h, conv.index_select(0, slot)[0],
                                                                   rec.index_select(0, slot)[0], rows=rows)
                conv.index_copy_(0, slot, new_conv.unsqueeze(0).to(conv.dtype))
                rec.index_copy_(0, slot, new_rec.unsqueeze(0).to(rec.dtype))
        else:
            a = model.kv_index[i]
            attn = layer.self_attn
            q, gate, k, v = attn.qkv(h, cos, sin)
            if paged:
                kv.write(a, idx.write, k, v)  # padding rows have slot -1: written nowhere
                o = kv.prefill_attention(a, q, idx.pages, 0, attn.scale, valid=L, meta=idx.meta)
            else:
                assert idx.host is not None, "the gather attention path needs the pass's host values"
                start, n = idx.host
                kv.write(a, idx.write[:n], k[:n], v[:n])
                pages = idx.pages[:-(-(start + n) // kv.page_tokens)]
                o = prefill_attention(attn, q[:n], kv, a, pages, start)
                if n < L:
                    o = torch.cat([o, o.new_zeros(L - n, *o.shape[1:])])
            out = attn.finish(o, gate)
        x = x + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in captured:
            j = captured.index(i)
            features_out[:, j * width:(j + 1) * width].copy_(x)
    # the lane's hidden and its taps' in one gather, norm and copy (the kept rows follow the image
    # slots; a slot not used repeats the lane's slot and last row, so a repeated index writes
    # equal values)
    if hidden_out is not None:  # every row's hidden; the kept ones from the same norm
        hidden_out.copy_(model.norm(x))
        kept = hidden_out.index_select(0, idx.kept_rows)
    else:
        kept = model.norm(x.index_select(0, idx.kept_rows))
    states.hidden.index_copy_(0, idx.image_slots, kept.to(states.hidden.dtype))
    x = kept[:1]
    logits = model.lm_head(x)
    return PrefillCoreOut(logits=logits[0], hidden_last=x[0], hidden=hidden_out, features=features_out)
