"""CUDA graphs of decode's column pass.

A decode step of a hybrid model is hundreds of small kernels (for each layer: norms, projections,
the conv window, the gated delta rule or paged attention, the MLP); launched one by one from
Python their launch cost, not the GPU, sets the step time. A graph replays the whole step as one
launch.

:func:`hpc_cli.model.columns.columns_core` reads only device tensors (the packed
:class:`~hpc_cli.model.columns.ColumnIndex`) and has no value-dependent shapes when the pool is
read by the paged attention kernel, so one graph per ``(lanes, table width)`` serves every step:
a replay first copies the step's packed index (tokens, positions, slots, KV write slots, lengths,
page tables) into the graph's static buffer, in one host-to-device copy.

* The first step of a new key runs eagerly (it compiles the Triton kernels and creates the cuBLAS
  handles); the second captures the graph and replays it. Capture runs no kernel, so no state is
  written twice.
* A replay runs exactly the kernels of the eager pass with the same shapes, so its results are
  the eager pass's bits: decode and the speculative verify pass stay bit-identical.
* Graphs bake in the KV pool's and the state slots' storage (the key holds their ids) and the
  NVFP4 global scales (also in the key).
* Used for dense models on CUDA with a pool the paged kernel reads; MoE layers route on values
  (and the expert tier reads the host), so MoE models decode eagerly. ``HPC_CUDA_GRAPHS=0``
  turns graphs off; a failed capture turns them off for the model with one warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from hpc_cli.model.columns import ColumnIndex, ColumnsOut, columns_core, table_width

log = logging.getLogger(__name__)

#: graphs kept per model (each holds its static buffers; intermediates share one memory pool)
MAX_GRAPHS = 64


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    index: ColumnIndex
    out: ColumnsOut


class DecodeGraphs:
    """The graphs of one model's decode steps."""

    def __init__(self, model) -> None:
        self.model = model
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()
        self.pool = None
        self.disabled: str | None = None
        self.replays = 0
        self.captures = 0

    @staticmethod
    def wanted(model, kv) -> bool:
        from hpc_cli.model.moe import SparseMoE

        if os.environ.get("HPC_CUDA_GRAPHS", "1").strip().lower() in ("0", "false", "no", "off"):
            return False
        if model.device.type != "cuda" or any(isinstance(l.mlp, SparseMoE) for l in model.layers):
            return False
        return kv.paged_attention_supported(model.config.num_attention_heads)

    def _key(self, B: int, W: int, kv, states) -> tuple:
        scales = tuple(kv.global_scales.flatten().tolist()) if kv.profile.uses_global_scale else ()
        return (B, W, id(kv), id(states), scales, int(getattr(self.model, "row_block", None) or 0))

    def decode(self, tokens: torch.Tensor, positions: Sequence[int], tables: Sequence[Sequence[int]],
               slots: Sequence[int], kv, states) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one decode step (``tokens`` ``[B]`` on the host)."""
        model = self.model
        B = tokens.shape[0]
        toks = tokens.view(B, 1)
        page = kv.page_tokens
        W = table_width(tables, positions, 1, page)
        packed = ColumnIndex.pack(toks, positions, tables, slots, page, W).pin_memory()
        key = self._key(B, W, kv, states)
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and len(self.graphs) < MAX_GRAPHS:
            entry = self._capture(key, packed, B, W, kv, states)
        if entry is None:  # the first step of this key (warm-up), or graphs unavailable
            self.seen.add(key)
            idx = ColumnIndex.view(packed.to(model.device, non_blocking=True), B, 1, W)
            return columns_core(model, idx, kv, states, keep_all=False).logits[:, 0]
        entry.index.packed.copy_(packed, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.out.logits[:, 0].clone()

    def _capture(self, key, packed: torch.Tensor, B: int, W: int, kv, states) -> _Graph | None:
        model = self.model
        static = packed.to(model.device)
        idx = ColumnIndex.view(static, B, 1, W)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                out = columns_core(model, idx, kv, states, keep_all=False)
        except Exception as exc:  # a kernel or library that cannot be captured: decode eagerly
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, decoding without graphs: %s", self.disabled)
            return None
        self.captures += 1
        entry = _Graph(graph, idx, out)
        self.graphs[key] = entry
        return entry
