"""CUDA graphs of prefill passes: one launch for a whole pass.

A prefill pass of a few hundred tokens through the 27B widths is about 9 ms of device work but,
launched op by op from Python, about 15 ms of host time (some 600 launches, fla's wrappers and
autotuner lookups for each GDN layer): a cached turn, which prefills only its new tokens, paid
mostly launch overhead. :func:`hpc_cli.model.prefill_core.prefill_core` computes a pass from
device indices only, so its kernels can be captured once per shape and replayed:

* The key is ``(L, W)``: the pass's padded length (a multiple of ``HybridModel.prefill_pad``) and
  its page table width (:func:`hpc_cli.model.prefill_core.table_width`, 512 pages and up), plus
  the pools the graph writes. The warm-up (:mod:`hpc_cli.engine.warmup`) runs every length twice:
  the first pass of a key runs eagerly (kernels compile and tune there), the second captures the
  graph and replays it. Capture runs no kernel, so nothing is written twice.
* A replay copies the pass's packed index into the graph's static buffer (one host-to-device
  copy) and launches the graph; its logits and hidden are cloned out, so the static outputs are
  free for the next replay.
* Graphs bake in the KV pool's and the state slots' storage (and NVFP4 global scales): the key
  carries the pools' serial numbers, and a model several engines use in turn keeps each one's
  graphs, as its decode graphs do (:mod:`hpc_cli.model.graphs`).
* A pass with exact taps inside it (the zero-split tap, :mod:`hpc_cli.model.gdn_taps`) runs a
  graph of the same length with :data:`~hpc_cli.model.gdn_taps.TAP_SLOTS` tap slots (key
  ``slots``): the taps' offsets and state slots are read from the index, and the pass writes
  each tap's image straight into its state slot.
* What a speculative backend reads of a pass (every position's hidden for MTP, the residual
  stream after some layers for DFlash) is written into buffers that all the graphs share (one a
  kind, as many rows as the longest pass: :attr:`PrefillGraphs.reserve_rows`, set by the warm-up)
  and copied out after the replay, so a graph holds no output of its own for them; the key carries
  which outputs a pass writes.
* Used where the column graphs are (dense models on CUDA, a pool the paged kernel reads, ``[engine]
  cuda_graphs``); a pass that wants every position's logits (prompt logprobs) or carries image
  embeddings runs eagerly. A failed capture turns prefill graphs off for the model with one
  warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from hpc_cli.model.graphs import CapturedGraphs
from hpc_cli.model.gdn_taps import tap_capacity
from hpc_cli.model.prefill_core import PrefillCoreOut, PrefillIndex, prefill_core, table_width

if TYPE_CHECKING:
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.memory.state_pool import StateSlots
    from hpc_cli.model.model import HybridModel


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    index: PrefillIndex
    out: PrefillCoreOut


class PrefillGraphs(CapturedGraphs):
    """The prefill graphs of one model (intermediates share one memory pool)."""

    def __init__(self, model: "HybridModel") -> None:
        super().__init__()
        self.model = model
        self.graphs: dict[tuple, _PrefillGraph] = {}
        self.seen: set[tuple] = set()
        self.eager = 0
        #: taps a pass takes itself (0 where fla's kernels or the tap recurrence do not take the
        #: model: the pass splits at each)
        self.tap_slots = tap_capacity(model.device, model.config.linear_key_head_dim)
        #: rows of the shared output buffers (the longest pass expected; a longer one makes them anew)
        self.reserve_rows = 0
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._held: list[torch.Tensor] = []  # every buffer a graph was captured with stays alive

    def _buffer(self, kind: str, cols: int, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the shared ``kind`` output buffer of ``cols`` columns."""
        buf = self._buffers.get((kind, cols))
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(rows, self.reserve_rows), cols, dtype=self.model.dtype, device=self.model.device)
            self._buffers[(kind, cols)] = buf
            self._held.append(buf)  # a captured graph writes it by address
        return buf[:rows]

    def _outputs(self, L: int, all_hidden: bool, capture: tuple[int, ...], shared: bool) -> dict:
        """``prefill_core``'s output tensors for a pass of ``L`` rows: views of the shared buffers
        (``shared``: a graph's capture) or new tensors (an eager pass)."""
        H = self.model.config.hidden_size
        kw: dict = {}
        if all_hidden:
            kw["hidden_out"] = (self._buffer("hidden", H, L) if shared else
                                torch.empty(L, H, dtype=self.model.dtype, device=self.model.device))
        if capture:
            cols = len(capture) * H
            kw["features_out"] = (self._buffer("features", cols, L) if shared else
                                  torch.empty(L, cols, dtype=self.model.dtype, device=self.model.device))
            kw["capture"] = capture
        return kw

    def _drop_binding(self, bound: tuple) -> None:
        self.graphs = {k: g for k, g in self.graphs.items() if k[0] != bound}
        self.seen = {k for k in self.seen if k[0] != bound}
        if not self.graphs:
            self.pool = None  # a pool whose graphs are all gone cannot take a capture again

    def _key(self, L: int, W: int, slots: int, kv: "PagedKVStorage", states: "StateSlots") -> tuple:
        bound = self.bind(kv, states)
        scales = tuple(kv.global_scales.flatten().tolist()) if kv.profile.uses_global_scale else ()
        return (bound, L, W, slots, scales)

    def run(self, tokens: Sequence[int] | torch.Tensor, start: int, block_table: Sequence[int], state_slot: int,
            kv: "PagedKVStorage", states: "StateSlots", taps: Sequence[tuple[int, int]] = (), *,
            all_hidden: bool = False, capture: Sequence[int] = ()) -> PrefillCoreOut:
        """One lane's pass of ``tokens`` at ``start ..``, padded to a multiple of the model's
        ``prefill_pad``; through a graph from the second pass of its shape on. ``taps``: ``(offset
        inside the pass, state slot)`` of each image the pass writes (at most :attr:`tap_slots`).
        ``all_hidden``/``capture``: every valid row's hidden / the residual stream after the
        ``capture`` layers come back too (``hidden``, ``features``: ``[len(tokens), ...]``)."""
        model = self.model
        page = kv.page_tokens
        n = len(tokens)
        pad = max(1, int(model.prefill_pad))
        L = -(-n // pad) * pad
        W = table_width((start + n + page - 1) // page)
        k1 = model.config.linear_conv_kernel_dim - 1
        assert len(taps) <= self.tap_slots, f"{len(taps)} taps do not fit {self.tap_slots} tap slots"
        slots = self.tap_slots if taps else 0
        packed = PrefillIndex.pack(tokens, start, block_table, state_slot, L, W, page, k1, taps, slots).pin_memory()
        capture = tuple(sorted(set(capture)))
        key = (*self._key(L, W, slots, kv, states), all_hidden, capture)
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and self.disabled is None:
            entry = self._capture(key, packed, L, W, slots, kv, states, all_hidden, capture)
        if entry is None:  # the first pass of this shape (warm-up), or graphs unavailable
            self.seen.add(key)
            self.eager += 1
            idx = PrefillIndex.view(packed.to(model.device, non_blocking=True), L, W, host=(start, n), slots=slots)
            out = prefill_core(model, idx, kv, states, **self._outputs(L, all_hidden, capture, shared=False))
            hidden, feats = out.hidden, out.features
        else:
            entry.index.packed.copy_(packed, non_blocking=True)
            entry.graph.replay()
            self.replays += 1
            out = PrefillCoreOut(entry.out.logits.clone(), entry.out.hidden_last.clone())
            hidden = entry.out.hidden.clone() if entry.out.hidden is not None else None
            feats = entry.out.features.clone() if entry.out.features is not None else None
        out.hidden = hidden[:n] if hidden is not None else None
        out.features = feats[:n] if feats is not None else None
        return out

    def _capture(self, key: tuple, packed: torch.Tensor, L: int, W: int, slots: int, kv: "PagedKVStorage",
                 states: "StateSlots", all_hidden: bool, capture: tuple[int, ...]) -> _PrefillGraph | None:
        model = self.model
        idx = PrefillIndex.view(packed.to(model.device), L, W, slots=slots)
        outputs = self._outputs(L, all_hidden, capture, shared=True)
        captured = self.try_capture(lambda: prefill_core(model, idx, kv, states, **outputs), "prefilling")
        if captured is None:
            return None
        graph, out = captured
        entry = _PrefillGraph(graph, idx, out)
        self.graphs[key] = entry
        return entry
