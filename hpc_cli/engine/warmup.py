"""The warm-up: every kernel shape that serving will meet is compiled, tuned and captured before
the first request, so no request waits for Triton or a CUDA graph capture.

On CUDA a prefill pass is padded to a multiple of ``model.prefill_pad`` tokens
(:meth:`hpc_cli.model.model.HybridModel.prefill`), so prefill kernels meet only
``ceil(chunk / pad)`` lengths; a decode step's shapes are its lane count ``B <= C`` and its page
table width ``W`` (a power of two >= 8, :func:`hpc_cli.model.columns.table_width`), so decode
meets ``C * log2(max W / 4)`` shapes (with speculation, the verify pass's ``k + 1`` column counts
for each, and the drafter's own captured shapes: MTP's steps for each lanes x width x ``1..k``
drafts). :func:`plan` lists them all and :func:`run_shapes` runs
each once, twice where CUDA graphs are used (decode, and prefill passes: the first pass of a graph
key runs eagerly, the second captures); where the cache mode has passes take their exact taps
themselves, each prefill length also runs with taps (the graph with tap slots).
The passes write only free pages and the lanes' own state slots, which are reset afterwards;
run it on the engine's worker thread before the first request, while the device pool holds no
cached block. On the CPU nothing is compiled and the plan is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from hpc_cli.cache.keys import BLOCK_TOKENS

if TYPE_CHECKING:
    from hpc_cli.engine.engine import Engine

#: real lengths besides the padded buckets: a KV write's row count is specialised by Triton on
#: divisibility by 16 (and on being 1), so short odd passes are warmed too
SHORT_LENGTHS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    """What the warm-up runs: prefill passes of ``prefill_lengths`` real tokens, decode steps of
    every ``decode_batches`` x ``decode_widths`` (lanes, page table width)."""

    prefill_lengths: tuple[int, ...] = ()
    decode_batches: tuple[int, ...] = ()
    decode_widths: tuple[int, ...] = ()
    #: speculative verify passes: every lanes x columns (``1 .. k + 1``: a round near
    #: ``max_tokens`` drafts fewer) x table width
    verify_batches: tuple[int, ...] = ()
    verify_columns: tuple[int, ...] = ()

    @property
    def steps(self) -> int:
        return len(self.prefill_lengths) + (len(self.decode_batches) + len(self.verify_batches)
                                            * len(self.verify_columns)) * len(self.decode_widths)


def plan(engine: "Engine") -> WarmupPlan:
    """The shapes of this engine's prefill passes and decode steps (empty off CUDA)."""
    model = engine.model
    if model.device.type != "cuda":
        return WarmupPlan()
    pad = max(1, int(getattr(model, "prefill_pad", 1)))
    top = min(engine.chunk, engine.max_model_len - 1)
    if pad > 1:
        lengths = sorted({*(n for n in SHORT_LENGTHS if n <= top), *range(pad, top + 1, pad),
                          *([top] if top % pad else [])})
    else:  # unpadded (MoE): the lengths a pass can have are too many; warm the chunk and short passes
        lengths = sorted({*(n for n in SHORT_LENGTHS if n <= top), top})
    widest = 1 << max(3, (-(-engine.max_model_len // BLOCK_TOKENS) - 1).bit_length())
    widths = []
    w = 8
    while w <= widest:
        widths.append(w)
        w *= 2
    lanes = tuple(range(1, engine.C + 1))
    if engine.spec is None:
        return WarmupPlan(tuple(lengths), lanes, tuple(widths))
    return WarmupPlan(tuple(lengths), (), tuple(widths), lanes, tuple(range(1, engine.spec.k + 2)))


@dataclass(slots=True)
class WarmupReport:
    """Seconds the warm-up spent: its first prefill pass (most compilations), the other prefill
    lengths, and the decode shapes (eager pass and graph capture each)."""

    first_prefill_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def run_shapes(engine: "Engine", shapes: WarmupPlan,
               progress: Callable[[int, int], None] | None = None) -> WarmupReport:
    """Run every planned pass once (decode twice) on the engine's pools; call on the worker thread."""
    import time

    report = WarmupReport()
    model, kv, states = engine.model, engine.storage, engine.states
    num_pages = kv.num_pages
    vocab = model.config.vocab_size
    done = 0
    slot = 0
    t0 = time.perf_counter()
    graphs = model.prefill_graphs(kv)
    # a pass that takes exact taps itself runs a graph with tap slots: warm those too
    from hpc_cli.model.model import TapImage

    scratch = list(getattr(engine.cache, "tap_scratch", ()))
    slots = min(graphs.tap_slots, len(scratch)) if graphs is not None else 0
    # a speculative backend's passes return every position's hidden or some layers' features
    spec_kw = engine.spec.prefill_kwargs() if engine.spec is not None else {}
    if graphs is not None and shapes.prefill_lengths:
        graphs.reserve_rows = max(graphs.reserve_rows, -(-max(shapes.prefill_lengths) // model.prefill_pad)
                                  * model.prefill_pad)
    for n in shapes.prefill_lengths:
        tokens = [(7 * i + 3) % max(2, vocab - 1) + 1 for i in range(n)]
        table = [i % num_pages for i in range(-(-n // BLOCK_TOKENS))]
        variants = [[]] + ([[TapImage(n * (j + 1) // (slots + 1), scratch[j]) for j in range(slots)]]
                           if slots and n > slots else [])
        for tapped in variants:
            for _ in range(2 if graphs is not None else 1):  # eager, then the capture of its graph
                states.reset(slot)
                model.prefill(tokens, 0, table, slot, kv, states, taps=tapped, **spec_kw)
        if done == 0:
            torch.cuda.synchronize(model.device)
            report.first_prefill_s = time.perf_counter() - t0
        done += 1
        if progress is not None:
            progress(done, shapes.steps)
    torch.cuda.synchronize(model.device)
    t1 = time.perf_counter()
    report.prefill_s = t1 - t0 - report.first_prefill_s
    for B in shapes.decode_batches:
        for W in shapes.decode_widths:
            p = min(W * BLOCK_TOKENS, engine.max_model_len) - 1
            need = p // BLOCK_TOKENS + 1
            tables = [[(b * need + i) % num_pages for i in range(need)] for b in range(B)]
            slots = list(range(B))
            for s in slots:
                states.reset(s)
            for _ in range(2):  # eager, then the capture of its graph
                model.decode([1 + b for b in range(B)], [p] * B, tables, slots, kv, states)
            done += 1
            if progress is not None:
                progress(done, shapes.steps)
    done = _verify_shapes(engine, shapes, done, progress)
    _draft_shapes(engine, shapes)
    for s in range(engine.C):
        states.reset(s)
    torch.cuda.synchronize(model.device)
    report.decode_s = time.perf_counter() - t1
    return report


def _verify_shapes(engine: "Engine", shapes: WarmupPlan, done: int,
                   progress: Callable[[int, int], None] | None) -> int:
    """The speculative verify passes of every planned shape, eager then captured, the way the
    rounds will run them (the runtime's rollback and the drafter's captured layers), each followed
    by the round's tail (the commit, and the drafter's catch-up), eager then captured. A graph is
    captured only while the kept graphs' outputs fit their budget (a verify graph keeps every
    column's GDN states): past it a shape runs once, which compiles its kernels, and its graph is
    captured when serving meets it twice. Where rounds chain their verify passes (the runtime's
    ``chains``), a shape of ``k + 1`` columns gets a second graph and its tails too (a chained pass
    must not overwrite the outputs of the pass before it, which the host is still reading), after
    every shape's first graph and within the budget.
    Returns the steps done."""
    from hpc_cli.speculative.ops import verify_pass, warm_chained

    spec = engine.spec
    if spec is None or not shapes.verify_batches:
        return done
    model, kv, states = engine.model, engine.storage, engine.states
    graphs = model.column_graphs(kv)
    keep_all = spec.rollback == "per_token"
    capture = tuple(spec.drafter.capture or ())

    def verify(B: int, T: int, tokens: torch.Tensor, last: int, tables: list[list[int]], second: bool = False):
        return verify_pass(model, tokens, [last - T + 1] * B, tables, list(range(B)), kv, states, keep_all=keep_all,
                           capture=capture, second=second)

    per_column = 0  # static output bytes of a captured graph per lane and column
    chained: list[tuple] = []  # shapes whose second graph rounds chaining their verify passes replay
    for B in shapes.verify_batches:
        for T in shapes.verify_columns:
            for W in shapes.decode_widths:
                last = min(W * BLOCK_TOKENS, engine.max_model_len) - 1
                need = last // BLOCK_TOKENS + 1
                tables = [[(b * need + i) % kv.num_pages for i in range(need)] for b in range(B)]
                tokens = torch.tensor([[1 + (b + t) % 7 for t in range(T)] for b in range(B)], dtype=torch.long)
                fits = graphs is not None and graphs.held + per_column * B * T <= graphs.budget
                for _ in range(2 if fits else 1):  # eager, then the capture of its graph
                    held = graphs.held if graphs is not None else 0
                    out = verify(B, T, tokens, last, tables)
                    if graphs is not None and graphs.held > held and not per_column:
                        per_column = (graphs.held - held) // (B * T)
                spec.warm_tails(out)  # the round's commit (and catch-up) after this verify graph
                if fits and spec.chains(T):
                    chained.append((B, T, tokens, last, tables))
                for s in range(B):
                    states.reset(s)
                done += 1
                if progress is not None:
                    progress(done, shapes.steps)
    # the second graphs of the shapes rounds chain (k + 1 columns), fewest lanes first, once every
    # shape has its first graph and only while the budget holds them (a chained round needs both)
    for B, T, tokens, last, tables in sorted(chained, key=lambda c: c[0]):
        if graphs.held + per_column * B * T > graphs.budget:
            break
        for _ in range(2):  # eager, then the capture
            out = verify(B, T, tokens, last, tables, second=True)
        spec.warm_tails(out)
        warm_chained(model, kv, states, B, T, out.index.W, capture=capture, verdict=out.verdict)
        for s in range(B):
            states.reset(s)
    return done


def _draft_shapes(engine: "Engine", shapes: WarmupPlan) -> None:
    """The drafter's own captured shapes, where it has any (MTP's ``k`` steps: every lanes x
    table width x ``1..k`` drafts), through the drafter contract's optional ``warm`` (the slots it
    touches are reset with every other after the decode shapes)."""
    spec = engine.spec
    warm = getattr(spec.drafter, "warm", None) if spec is not None else None
    if warm is not None and shapes.verify_batches:
        warm(shapes.verify_batches, shapes.decode_widths, spec.k, engine.states, engine.storage.num_pages,
             engine.max_model_len)
