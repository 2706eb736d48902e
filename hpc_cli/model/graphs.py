"""CUDA graphs of the column pass (decode steps and speculative verify passes).

A decode step of a hybrid model is hundreds of small kernels (for each layer: norms, projections,
the conv window, the gated delta rule or paged attention, the MLP); launched one by one from
Python their launch cost, not the GPU, sets the step time. A graph replays the whole step as one
launch.

:func:`hpc_cli.model.columns.columns_core` reads only device tensors (the packed
:class:`~hpc_cli.model.columns.ColumnIndex`) and has no value-dependent shapes when the pool is
read by the paged attention kernel, so one graph per ``(lanes, columns, table width, outputs)`` serves every step:
a replay first copies the step's packed index (tokens, positions, slots, KV write slots, lengths,
page tables) into the graph's static buffer, in one host-to-device copy.

* The first step of a new key runs eagerly (it compiles the Triton kernels and creates the cuBLAS
  handles); the second captures the graph and replays it. Capture runs no kernel, so no state is
  written twice.
* A replay runs exactly the kernels of the eager pass with the same shapes, so its results are
  the eager pass's bits: decode and the speculative verify pass stay bit-identical.
* The speculative verify pass (``T = k + 1`` columns, per-column states kept) runs through the
  same graphs; its static outputs are consumed within the round. Each such graph holds its
  per-column recurrent states (``B * T`` images of every GDN layer's fp32 state) for its lifetime.
* A speculative round may launch the next round's verify pass before reading its own
  (:meth:`ColumnGraphs.replay_filled`): that pass replays the shape's second graph, captured in a
  memory pool of its own, wherever the pass still to be read is a first graph's, and a first
  graph wherever it is a second's, so neither writes where the other's outputs live.
* Kept graphs are bounded: at most ``MAX_GRAPHS`` and ``OUTPUT_BUDGET_SHARE`` of the device's
  memory (at most 4 GiB) of static outputs, least recently used dropped first; a pass whose
  outputs alone exceed the budget (a wide verify of a big model) runs eagerly.
* Graphs bake in the KV pool's and the state slots' storage and the NVFP4 global scales (in the
  key, with the pools' serial numbers): a model several engines use in turn keeps each one's
  graphs (the last :data:`MAX_BINDINGS` bindings'), and never replays one for other pools.
* Used for dense models on CUDA with a pool the paged kernel reads; MoE layers route on values
  (and the expert tier reads the host), so MoE models decode eagerly. ``[engine] cuda_graphs =
  false`` (or, for a model used without an engine, ``HPC_CUDA_GRAPHS=0``) turns graphs off; a
  failed capture turns them off for the model with one warning.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from hpc_cli.model.columns import ColumnIndex, ColumnsOut, columns_core, table_width
from hpc_cli.model.layers import env_switch
from hpc_cli.model.staging import HostStaging

log = logging.getLogger(__name__)
T = TypeVar("T")

#: graphs kept per model (each holds its static buffers; intermediates share one memory pool)
MAX_GRAPHS = 128
#: static output bytes the kept graphs may hold together, as a share of the device's memory and at
#: most 4 GiB: a verify graph keeps every column's GDN states (for the 27B shape 151 MiB per lane
#: and column), so least recently used graphs are dropped past it, and a pass whose outputs alone
#: exceed it runs eagerly
OUTPUT_BUDGET_SHARE = 0.05
OUTPUT_BUDGET_MAX = 4 << 30
#: pool bindings whose graphs a set keeps: a model that several engines use in turn (a benchmark's
#: backends side by side, the tests) keeps each engine's graphs, keyed by its pools' serials,
#: instead of dropping them at every switch (and capturing them again while serving, without the
#: second verify graphs only the warm-up captures); past this many the least recently bound
#: pools' graphs are dropped
MAX_BINDINGS = 16
_SERIALS = itertools.count(1)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    index: ColumnIndex
    out: ColumnsOut
    nbytes: int


#: what writes a chained pass's index on the device: ``fill(index, sent, *inputs)``
#: (:meth:`ColumnGraphs.replay_filled`)
FillFn = Callable[..., None]


@dataclass
class _Fill:
    """A small graph that writes a captured pass's index on the device (:meth:`ColumnGraphs.replay_filled`)
    from static inputs: the host's staged buffer (``staged``) and device values copied in
    (``inputs``)."""
    graph: torch.cuda.CUDAGraph
    staged: torch.Tensor
    inputs: tuple[torch.Tensor, ...]


@dataclass
class PreparedDecode:
    """A decode step's packed index built ahead, while the device runs the step before, with its
    tokens left to fill (``packed[:B]``), and the graph it replays. It is used only for exactly
    the inputs it was built from (:meth:`matches`): the packed index is a function of the tokens,
    positions, page tables, state slots and rotary offsets alone."""
    key: tuple
    entry: _Graph
    packed: torch.Tensor  # pinned int64 host buffer; its first B entries are the tokens
    positions: list[int]
    tables: list[list[int]]
    slots: list[int]
    rope_offsets: list[int] | None

    def matches(self, positions: Sequence[int], tables: Sequence[Sequence[int]], slots: Sequence[int],
                rope_offsets: Sequence[int] | None) -> bool:
        return (self.positions == list(positions) and self.slots == list(slots)
                and self.rope_offsets == (None if rope_offsets is None else list(rope_offsets))
                and self.tables == [list(t) for t in tables])


def _out_bytes(out: ColumnsOut) -> int:
    parts = [out.logits, out.hidden, out.features, *(out.windows or ()), *(out.states or ())]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def capture_graph(pool, fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn``'s kernels captured into a new CUDA graph whose intermediates live in ``pool``
    (``torch.cuda.graph_pool_handle()``), and what ``fn`` returned (the graph's static outputs).
    Raises what the capture raised. thread_local: CUDA calls of the server's other threads never
    invalidate a capture."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    # no garbage collection inside the capture: collecting an old graph (a dropped engine's) there
    # destroys it mid-capture, which CUDA forbids and which invalidates the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class CapturedGraphs:
    """What every set of CUDA graphs keeps (the column passes', the prefill passes', a drafter's):
    the memory pool their intermediates share, why capturing was turned off, and counts."""

    def __init__(self) -> None:
        self.pool = None
        self.disabled: str | None = None
        self.replays = 0
        self.captures = 0
        self.bound: tuple | None = None  # serials of the pools bound now (:meth:`bind`)
        self.bindings: OrderedDict[tuple, None] = OrderedDict()  # pool serials, least recently bound first

    def bind(self, kv, states) -> tuple:
        """The serials of the pools ``kv`` and ``states`` (:func:`pool_serials`), bound now. Graphs
        hold raw addresses of their pools' storage, so their keys start with these serials (an
        object id can be reused after its pool is freed) and a graph is replayed only for the pools
        it was captured with. The graphs of the last :data:`MAX_BINDINGS` bindings are kept (a
        model several engines use in turn); a binding's past them are dropped
        (:meth:`_drop_binding`), never replayed."""
        bound = pool_serials(kv, states)
        if bound != self.bound:
            self.bound = bound
            self.bindings[bound] = None
            self.bindings.move_to_end(bound)
            while len(self.bindings) > MAX_BINDINGS:
                self._drop_binding(self.bindings.popitem(last=False)[0])
        return bound

    def _drop_binding(self, bound: tuple) -> None:
        """Drop the graphs captured for the pools ``bound`` (their keys start with it)."""
        raise NotImplementedError(f"{type(self).__name__} keeps graphs by binding but cannot drop them")

    def try_capture(self, fn: Callable[[], T], what: str, pool=None) -> tuple[torch.cuda.CUDAGraph, T] | None:
        """:func:`capture_graph` of ``fn`` into this set's pool (made on first use); None when it
        fails: a kernel or library that cannot be captured turns capturing off for the set
        (:attr:`disabled`), with one warning naming ``what`` runs without graphs from now on.
        ``pool``: another memory pool than the set's."""
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            captured = capture_graph(pool if pool is not None else self.pool, fn)
        except Exception as exc:
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, %s without graphs: %s", what, self.disabled)
            return None
        self.captures += 1
        return captured


def pool_serials(kv, states) -> tuple[int, int]:
    """Serial numbers of the KV pool and the state slots a graph writes: graphs hold raw addresses
    of their storage, and an object id can be reused after its pool is freed."""
    for obj in (kv, states):
        if getattr(obj, "_graph_serial", None) is None:
            obj._graph_serial = next(_SERIALS)
    return (kv._graph_serial, states._graph_serial)


class ColumnGraphs(CapturedGraphs):
    """The graphs of one model's column passes (decode steps and speculative verify passes)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self.seen: set[tuple] = set()
        self.eager: set[tuple] = set()  # keys whose outputs alone exceed the budget
        self.held = 0  # static output bytes of the kept graphs
        self.evictions = 0
        self.prepared_replays = 0  # decode steps whose packed index was built ahead
        self.filled_replays = 0  # passes whose index the device wrote (:meth:`replay_filled`)
        #: the second graphs' memory pool and their outputs' serials (:meth:`replay_filled`)
        self.second_pool = None
        self.second_serials: set[int] = set()
        #: per captured graph (its outputs' serial) the graph that fills its index
        #: (:meth:`warm_fill`), in a memory pool of their own (they keep no outputs)
        self.fills: dict[int, _Fill] = {}
        self.fill_pool = None
        self.fill_replays = 0  # chained passes whose fill was a graph
        self.staging = HostStaging(model.device)  # the passes' packed indices on their way to the device
        total = torch.cuda.get_device_properties(model.device).total_memory if model.device.type == "cuda" else 0
        self.budget = min(OUTPUT_BUDGET_MAX, int(OUTPUT_BUDGET_SHARE * total))

    @staticmethod
    def wanted(model, kv) -> bool:
        from hpc_cli.model.moe import SparseMoE

        if not env_switch("HPC_CUDA_GRAPHS"):
            return False
        if not model.cuda_graphs:  # [engine] cuda_graphs = false
            return False
        if model.device.type != "cuda" or any(isinstance(l.mlp, SparseMoE) for l in model.layers):
            return False
        return kv.paged_attention_supported(model.config.num_attention_heads)

    def _drop_binding(self, bound: tuple) -> None:
        for key in [k for k in self.graphs if k[0] == bound]:
            self._forget(self.graphs.pop(key))
        self.seen = {k for k in self.seen if k[0] != bound}
        self.eager = {k for k in self.eager if k[0] != bound}
        self._forget_empty_pools()

    def _forget(self, entry: _Graph) -> None:
        """A dropped graph's bookkeeping: its bytes, its second-set serial and its fill graph."""
        self.held -= entry.nbytes
        self.second_serials.discard(entry.out.static)
        self.fills.pop(entry.out.static, None)

    def _forget_empty_pools(self) -> None:
        """A memory pool whose graphs are all gone cannot take a capture again: the next capture of
        its set makes a new one."""
        if not self.second_serials:
            self.second_pool = None
        if not self.fills:
            self.fill_pool = None
        if all(key[-1] == "second" for key in self.graphs):
            self.pool = None

    def _key(self, B: int, T: int, W: int, kv, states, keep_all: bool, capture: tuple, logits: bool) -> tuple:
        bound = self.bind(kv, states)
        scales = tuple(kv.global_scales.flatten().tolist()) if kv.profile.uses_global_scale else ()
        return (bound, B, T, W, keep_all, capture, logits, scales,
                int(getattr(self.model, "row_block", None) or 0))

    def decode(self, tokens: torch.Tensor, positions: Sequence[int], tables: Sequence[Sequence[int]],
               slots: Sequence[int], kv, states, rope_offsets: Sequence[int] | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one decode step (``tokens`` ``[B]`` on the host)."""
        out = self.run(tokens.view(-1, 1), positions, tables, slots, kv, states, keep_all=False,
                       rope_offsets=rope_offsets)
        return out.logits[:, 0].clone()

    def prepare_decode(self, positions: Sequence[int], tables: Sequence[Sequence[int]], slots: Sequence[int],
                       kv, states, rope_offsets: Sequence[int] | None = None) -> PreparedDecode | None:
        """The packed index of a decode step at ``positions`` with its tokens to come, built while
        the device still runs the step before (its host part off the step's critical path), when
        that step's graph is captured already; None otherwise."""
        B = len(positions)
        page = kv.page_tokens
        W = table_width(tables, positions, 1, page)
        key = self._key(B, 1, W, kv, states, False, (), True)
        entry = self.graphs.get(key)
        if entry is None:
            return None
        tokens = torch.zeros(B, 1, dtype=torch.long)
        packed = ColumnIndex.pack(tokens, positions, tables, slots, page, W, rope_offsets).pin_memory()
        return PreparedDecode(key, entry, packed, list(positions), [list(t) for t in tables], list(slots),
                              None if rope_offsets is None else list(rope_offsets))

    def decode_prepared(self, prepared: PreparedDecode, tokens: Sequence[int], kv, states) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` of the step ``prepared`` was built for, with ``tokens``; None when
        its graph is gone or its key changed since (the caller runs :meth:`decode`)."""
        B = len(tokens)
        assert B == len(prepared.positions), f"{B} tokens for a step of {len(prepared.positions)} lanes"
        key = self._key(B, 1, prepared.entry.index.W, kv, states, False, (), True)
        entry = self.graphs.get(key)
        if key != prepared.key or entry is not prepared.entry:
            return None
        prepared.packed[:B] = torch.as_tensor(tokens, dtype=torch.long)
        self.prepared_replays += 1
        return self._replay(key, entry, prepared.packed).logits[:, 0].clone()

    def _replay(self, key: tuple, entry: _Graph, packed: torch.Tensor,
                drafts: torch.Tensor | None = None, staged: bool = False) -> ColumnsOut:
        """``entry``'s graph on the step's ``packed`` index (``staged``: the last buffer of
        :attr:`staging`) and ``drafts`` on the device."""
        self.graphs.move_to_end(key)
        if staged:
            self.staging.send_into(packed, entry.index.packed)
        else:
            entry.index.packed.copy_(packed, non_blocking=True)
        if drafts is not None:
            entry.index.put_drafts(drafts)
        entry.graph.replay()
        self.replays += 1
        return entry.out

    def run(self, tokens: torch.Tensor | Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[Sequence[int]],
            slots: Sequence[int], kv, states, *, keep_all: bool, capture: Sequence[int] = (),
            logits: bool = True, rope_offsets: Sequence[int] | None = None,
            drafts: torch.Tensor | None = None, second: bool = False) -> ColumnsOut:
        """The column pass of ``tokens`` ``[B, T]`` (on the host: a tensor or rows) through a graph. The result's
        tensors are the graph's static outputs: valid until the next run with the same shape
        (decode clones its logits; the speculative round consumes its verify result at once).
        ``drafts``: columns ``1..T-1`` of the tokens on the device (copied into the packed index
        after the host's part, before the replay). ``second``: the key's second graph (its own
        static outputs: :meth:`replay_filled` runs a pass while the first's are still read)."""
        model = self.model
        B, T = (tokens.shape if torch.is_tensor(tokens) else (len(tokens), len(tokens[0])))
        page = kv.page_tokens
        W = table_width(tables, starts, T, page)
        packed = self.staging.stage(ColumnIndex.pack_values(tokens, starts, tables, slots, page, W, rope_offsets))
        capture = tuple(sorted(set(capture)))
        key = self._key(B, T, W, kv, states, keep_all, capture, logits)
        if second:
            key = (*key, "second")
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and key not in self.eager:
            entry = self._capture(key, packed, B, T, W, kv, states, keep_all, capture, logits)
        if entry is None:  # the first pass of this key (warm-up), or graphs unavailable
            self.seen.add(key)
            idx = ColumnIndex.view(self.staging.send(packed), B, T, W)
            if drafts is not None:
                idx.put_drafts(drafts)
            return columns_core(model, idx, kv, states, keep_all=keep_all, capture=capture, logits=logits)
        return self._replay(key, entry, packed, drafts, staged=True)

    def _filled_target(self, B: int, T: int, W: int, kv, states, keep_all: bool, capture: Sequence[int],
                       second: bool) -> tuple[tuple, _Graph] | None:
        key = self._key(B, T, W, kv, states, keep_all, tuple(sorted(set(capture))), True)
        key = (*key, "second") if second else key
        entry = self.graphs.get(key)
        return None if entry is None else (key, entry)

    def replay_filled(self, B: int, T: int, W: int, kv, states, *, keep_all: bool, capture: Sequence[int],
                      fill: FillFn, staged: torch.Tensor, inputs: Sequence[torch.Tensor],
                      avoid: int) -> ColumnsOut | None:
        """A captured pass of ``B`` x ``T`` x ``W`` whose index ``fill(index, sent, *inputs)``
        writes on the device (``sent``: ``staged``, the last buffer of :attr:`staging`, on the
        device), replayed from a graph of the other set than the one whose outputs are ``avoid``.
        The fill is a graph of its own where :meth:`warm_fill` captured one for that graph (its
        inputs copied into its static buffers), else eager. None where that graph is not captured."""
        found = self._filled_target(B, T, W, kv, states, keep_all, capture, avoid not in self.second_serials)
        if found is None or found[1].out.static == avoid:
            return None
        key, entry = found
        self.graphs.move_to_end(key)
        f = self.fills.get(entry.out.static)
        if f is not None and f.staged.numel() == staged.numel() \
                and all(a.shape == b.shape for a, b in zip(f.inputs, inputs)):
            self.staging.send_into(staged, f.staged)
            for dst, src in zip(f.inputs, inputs):
                dst.copy_(src, non_blocking=True)
            f.graph.replay()
            self.fill_replays += 1
        else:
            fill(entry.index, self.staging.send(staged), *inputs)
        entry.graph.replay()
        self.replays += 1
        self.filled_replays += 1
        return entry.out

    def warm_fill(self, B: int, T: int, W: int, kv, states, *, keep_all: bool, capture: Sequence[int],
                  fill: FillFn, staged: int, inputs: Sequence[torch.Tensor]) -> int:
        """Capture the fill graphs of :meth:`replay_filled` for both graphs of a shape. Returns the
        fills captured."""
        done = 0
        for second in (True, False):
            found = self._filled_target(B, T, W, kv, states, keep_all, capture, second)
            if found is None or found[1].out.static in self.fills:
                continue
            entry = found[1]
            sent = torch.zeros(staged, dtype=torch.int64, device=self.model.device)
            static = tuple(torch.zeros_like(t) for t in inputs)
            if self.fill_pool is None:
                self.fill_pool = torch.cuda.graph_pool_handle()
            try:  # a fill that cannot be captured leaves the passes' graphs on: their fills run eagerly
                graph, _ = capture_graph(self.fill_pool, lambda: fill(entry.index, sent, *static))
            except Exception as exc:
                log.warning("CUDA graph capture of a chained pass's fill failed, its fills run eagerly: %s: %s",
                            type(exc).__name__, exc)
                return done
            self.captures += 1
            self.fills[entry.out.static] = _Fill(graph, sent, static)
            done += 1
        return done

    def _capture(self, key, packed: torch.Tensor, B: int, T: int, W: int, kv, states, keep_all: bool,
                 capture: tuple, logits: bool) -> _Graph | None:
        model = self.model
        static = packed.to(model.device)  # a copy the host waits for: the staged buffer is free after it
        idx = ColumnIndex.view(static, B, T, W)
        second = key[-1] == "second"
        if second and self.second_pool is None:
            self.second_pool = torch.cuda.graph_pool_handle()
        captured = self.try_capture(lambda: columns_core(model, idx, kv, states, keep_all=keep_all,
                                                         capture=capture, logits=logits), "decoding",
                                    pool=self.second_pool if second else None)
        if captured is None:
            return None
        graph, out = captured
        out.static = next(_SERIALS)
        if second:
            self.second_serials.add(out.static)
        return self._keep(key, _Graph(graph, idx, out, _out_bytes(out)))

    def _keep(self, key, entry: _Graph) -> _Graph | None:
        """Keep a captured graph within the budget (least recently used dropped first); None
        (and eager passes for this key from now on) when its outputs alone exceed the budget."""
        if entry.nbytes > self.budget:
            self.eager.add(key)
            return None
        self.graphs[key] = entry
        self.held += entry.nbytes
        while len(self.graphs) > 1 and (self.held > self.budget or len(self.graphs) > MAX_GRAPHS):
            self._forget(self.graphs.popitem(last=False)[1])  # its memory returns to the pool once unused
            self.evictions += 1
        self._forget_empty_pools()
        return entry
