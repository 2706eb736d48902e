"""The MTP drafter: the checkpoint's ``mtp.*`` head drafting ``k`` tokens autoregressively.

MTP position ``p`` reads ``fc([norm(embed(token[p+1])) ; norm(h[p])])`` where ``h[p]`` is the main
model's final-norm hidden at ``p``; its full-attention layer keeps K/V per position in one more
layer of pages of the main pool (layer index ``A`` = number of attention layers, so the block
bundle and the host slabs carry it). Position ``p`` needs token ``p+1``, so the MTP frontier is
one token behind the text frontier whenever the next token is not known yet.

Per lane the drafter keeps ``lane.backend_frontier`` (MTP K/V valid for ``[0, F_m)``):

* after a main pass over ``[s, e)`` (:meth:`observe`) it computes ``[F_m, e-1)`` from the pass's
  hiddens (``h[s-1]`` is the slot's continuation hidden read before the pass), and ``e-1`` too
  when token ``e`` is already known (inside the prompt); a resume starts at ``F_m = F - 1``, so
  the first pass rebuilds the bridge from the restored hidden (tap snapshots carry no MTP state);
* a round's first draft step computes position ``pos-1`` from ``(next_token, h[pos-1])``: the
  bridge to the frontier (committed) and the first draft; steps 2..k run at ``pos..pos+k-2`` on
  the previous step's MTP hidden and draft (provisional K/V, overwritten later).

After a greedy round whose tail counted its drafts on the device, that tail computes the bridge
itself (:meth:`catch_up_and_bridge`): one pass of the MTP layer over every verify column, the
rows up to each lane's count writing their K/V (the catch-up) and the row at the count (the
bridge, its token the bonus) giving the next round's first draft and its hidden, kept per state
slot. The next round's proposal, made ahead or at its start, then starts from them
(:meth:`propose_device` when :meth:`first_drafts` marked the lanes): at k = 1 it is a gather.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.speculative.draft_graphs import (INPUT_COLUMNS, DraftGraphs, ahead_inputs, no_draft_accepted,
                                              warm_proposals)
from hpc_cli.speculative.ops import (column_writes, page_rows, page_table, paged_attention, reads_in_place,
                                     span_attention, write_kv)


class MTPDrafter:
    name = "mtp"
    capture: tuple[int, ...] = ()
    needs_hidden = True

    def __init__(self, model) -> None:
        from hpc_cli.errors import ConfigError

        if getattr(model, "mtp", None) is None:
            raise ConfigError("speculative.backend 'mtp' needs the checkpoint's mtp.* weights; this model has none",
                              hint="use a Qwen3.5 checkpoint with its MTP head, or another backend")
        self.model = model
        self.mtp = model.mtp
        self.base_layer = len(model.config.attention_layers)  # first MTP layer of pages in the main pool
        self.storage = None
        self.graphs: DraftGraphs | None = None  # the captured proposals (CUDA, a pool the paged kernel reads)
        # the next round's first draft and its MTP hidden per state slot, written by a greedy
        # round's tail (:meth:`catch_up_and_bridge`), and for which lane and position they hold
        self._first_token: torch.Tensor | None = None
        self._first_hidden: torch.Tensor | None = None
        self._first_for: dict[int, tuple[object, int]] = {}
        self._slot_tensors: dict[tuple[int, ...], torch.Tensor] = {}  # :meth:`_slot_index`
        #: proposals that started from a tail's first drafts (made ahead, or at a round's start)
        self.proposals_from_first = 0

    def bind(self, storage, backend_storage, states) -> None:
        from hpc_cli.model.graphs import ColumnGraphs
        from hpc_cli.model.moe import SparseMoE

        assert storage.num_layers >= self.base_layer + len(self.mtp.layers), "main pool lacks the MTP layer"
        self.storage = storage
        # the k steps replay as one graph where the main model's decode does (a dense head: MoE
        # layers route on values), the steps' attention reading the pages in place
        dense = not any(isinstance(layer.mlp, SparseMoE) for layer in self.mtp.layers)
        wanted = (dense and ColumnGraphs.wanted(self.model, storage)
                  and reads_in_place(self.mtp.layers[0].self_attn, storage, 1))
        self.graphs = DraftGraphs(self.model.device) if wanted else None
        self._first_for = {}
        # the bridge runs the layer's MLP inside the round's tail, which may be captured: a
        # routed (MoE) MLP picks its experts from values, so such a head bridges in its own step
        if states is None or not dense:  # (a drafter bound to a pool alone keeps no slots either)
            self._first_token = self._first_hidden = None
            return
        n, dev = states.hidden.shape[0], self.model.device
        self._first_token = torch.zeros(n, dtype=torch.long, device=dev)
        self._first_hidden = torch.zeros(n, self.model.config.hidden_size, dtype=self.model.dtype, device=dev)

    # ------------------------------------------------------------------ the MTP stack
    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, last: Sequence[int],
             tables: Sequence[Sequence[int]], write: Sequence[bool] | None = None,
             table: tuple[torch.Tensor, int] | None = None):
        """``tokens``/``pos`` ``[B, T]`` (``last``: each lane's last position, on the host),
        ``hidden`` ``[B, T, H]`` -> (logits ``[B, T, V]``, MTP hidden). ``table``: the page table
        built once for several calls (:func:`~hpc_cli.speculative.ops.page_table`)."""
        m, mtp = self.model, self.mtp
        B, T = tokens.shape
        x, cos, sin = self._input(tokens, hidden, pos)
        for l, layer in enumerate(mtp.layers):
            h = layer.input_layernorm(x)
            x = x + paged_attention(layer.self_attn, h, pos, last, tables, self.storage, self.base_layer + l,
                                    cos, sin, write=write, table=table)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        g = mtp.norm(x)
        return m.lm_head(g).view(B, T, -1), g.view(B, T, -1)

    def _input(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        m, B, T = self.model, *tokens.shape
        x = self.mtp.combine(m._embed(tokens.reshape(-1)), hidden.reshape(B * T, -1).to(m.dtype))
        cos, sin = m.rotary.cos_sin(pos.reshape(-1), m.dtype)
        return x, cos, sin

    @torch.inference_mode()
    def _write_kv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, last: Sequence[int],
                  tables: Sequence[Sequence[int]]) -> None:
        """The MTP K/V of positions ``pos`` only, as :meth:`_run` writes them: the last layer's
        attention output, MLP, norm and ``lm_head`` (whose logits nobody reads) are skipped."""
        x, cos, sin = self._input(tokens, hidden, pos)
        layers = self.mtp.layers
        for l, layer in enumerate(layers):
            h = layer.input_layernorm(x)
            if l == len(layers) - 1:
                write_kv(layer.self_attn, h, pos, last, tables, self.storage, self.base_layer + l, cos, sin)
                return
            x = x + paged_attention(layer.self_attn, h, pos, last, tables, self.storage, self.base_layer + l, cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))

    # ------------------------------------------------------------------ frontier upkeep
    def observe(self, lane, start: int, n: int, hidden: torch.Tensor | None, features, pre_hidden, *,
                extend: bool) -> None:
        """The main model processed ``[start, start+n)`` (hiddens ``hidden[:n]``): catch the MTP
        K/V up to ``start+n-1`` (to ``start+n`` with ``extend`` when that token is known)."""
        end = start + n
        limit = end if (extend and len(lane.tokens) > end) else end - 1
        f = lane.backend_frontier if lane.backend_frontier is not None else max(0, start - 1)
        # a lane whose position moved without a pass of its own (a resume, in-flight coalescing)
        # rebuilds the bridge from start-1: the pages below came with the blocks
        f = max(f, start - 1, 0)
        if f >= limit:
            return
        dev = self.model.device
        rows = []
        for p in range(f, limit):
            rows.append(pre_hidden if p == start - 1 else hidden[p - start])
        hid = torch.stack(rows)[None]
        toks = torch.tensor(lane.tokens[f + 1:limit + 1], dtype=torch.long, device=dev)[None]
        pos = torch.arange(f, limit, device=dev)[None]
        self._write_kv(toks, hid, pos, [limit - 1], [lane.pages[:math.ceil(limit / PAGE_TOKENS)]])
        lane.backend_frontier = limit

    #: positions MTP's K/V stays behind the committed tokens after a catch-up (it needs the token
    #: after a position)
    columns_behind = 1

    @property
    def catches_up_columns(self) -> bool:
        """Whether :meth:`catch_up_columns` serves this drafter's pool (one MTP layer, a pool
        whose writes skip negative slots)."""
        return len(self.mtp.layers) == 1 and self.storage is not None and self.storage.skips_negative_slots

    @torch.inference_mode()
    def catch_up_columns(self, out, accepted: torch.Tensor) -> None:
        """A round's catch-up on the device: for every lane the MTP K/V of the ``accepted[b]``
        positions ``start .. start + accepted[b] - 1`` of the verify pass ``out`` (its tokens,
        hidden and write slots; the columns past a lane's count write nothing), which
        :meth:`observe` of the round computes lane by lane. No host value is read, so the
        runtime captures it with the round's commit (:mod:`hpc_cli.speculative.round_tail`).
        Only for lanes whose frontier is the round's start (``propose`` moved it there)."""
        idx = out.index
        B, T = idx.B, idx.T
        k = T - 1
        toks = idx.tokens.view(B, T)[:, 1:]  # the token after each position: the drafts
        pos, _, slots = column_writes(idx, k, accepted)
        x, cos, sin = self._input(toks, out.hidden[:, :k], pos)
        layer = self.mtp.layers[0]
        kk, vv = layer.self_attn.kv(layer.input_layernorm(x), cos, sin)
        self.storage.write(self.base_layer, slots.reshape(-1), kk, vv)

    @property
    def bridges_in_tail(self) -> bool:
        """Whether a greedy round's tail computes the next round's first draft with its catch-up
        (:meth:`catch_up_and_bridge`)."""
        return self.catches_up_columns and self._first_token is not None

    @torch.inference_mode()
    def catch_up_and_bridge(self, out, accepted: torch.Tensor) -> None:
        """A greedy round's catch-up and the next round's bridge in one pass of the MTP layer over
        the verify pass ``out``'s ``T`` columns: row ``t`` of a lane is position ``start + t``
        with the token after it, the argmax of column ``t`` (an accepted draft for ``t <
        accepted[b]``, the bonus at ``accepted[b]``), and the column's hidden. The rows up to the
        count write their K/V (the catch-up of :meth:`catch_up_columns`, then the bridge at the
        new frontier); each query reads its lane's pages up to its own position (the rows past
        the count, which write nothing, are computed and dropped). The bridge row's norm, head and
        argmax give the next round's first draft, kept with its hidden in the lane's state slot.
        Device values only (``accepted`` on the device): captured in the round's tail."""
        idx = out.index
        B, T = idx.B, idx.T
        tokens = out.verdict[:, T - 1:]  # every column's argmax: the token after its position
        pos, _, slots = column_writes(idx, T, accepted + 1)  # the rows up to the count write
        x, cos, sin = self._input(tokens, out.hidden, pos)
        layer = self.mtp.layers[0]
        attn = layer.self_attn
        q, gate, kk, vv = attn.qkv(layer.input_layernorm(x), cos, sin)
        self.storage.write(self.base_layer, slots.reshape(-1), kk, vv)
        if self.storage.paged_attention_supported(attn.n_heads):  # every row in one launch, as verify's
            o = self.storage.decode_attention(self.base_layer, q, idx.row_tables, idx.seqlens.reshape(-1), attn.scale)
        else:
            o = span_attention(attn, q, pos, idx.tables, idx.tables.shape[1], self.storage, self.base_layer)
        x = x + attn.finish(o, gate)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        g = self.mtp.norm(x.index_select(0, torch.arange(0, B * T, T, device=accepted.device) + accepted))
        self._first_token.index_copy_(0, idx.slots, self.model.lm_head(g).argmax(-1))
        self._first_hidden.index_copy_(0, idx.slots, g)

    def first_drafts(self, lanes, made: bool) -> None:
        """After a round of ``lanes`` (their positions moved on): ``made``, its tail computed each
        lane's bridge and first draft (:meth:`catch_up_and_bridge`), which the lane's next
        proposal starts from; else the lanes' slots hold none for them."""
        for l in lanes:
            if made:
                self._first_for[l.state_slot] = (l, l.pos)
            else:
                self._first_for.pop(l.state_slot, None)
        if made:
            self._bridged(lanes)

    def _slot_index(self, lanes) -> torch.Tensor:
        """The lanes' state slots as a device tensor, kept per set of slots (a few at any time:
        the running lanes'), so a round does not copy them again; a new set's copy is queued
        without a wait."""
        key = tuple(l.state_slot for l in lanes)
        t = self._slot_tensors.get(key)
        if t is None:
            if len(self._slot_tensors) >= 256:
                self._slot_tensors.clear()
            host = torch.tensor(key, dtype=torch.long)
            if self.model.device.type == "cuda":
                host = host.pin_memory()
            t = self._slot_tensors[key] = host.to(self.model.device, non_blocking=True)
        return t

    def _has_first(self, lanes) -> bool:
        return all((f := self._first_for.get(l.state_slot)) is not None and f[0] is l and f[1] == l.pos
                   for l in lanes)

    def admitted(self, lane) -> None:
        lane.backend_frontier = max(0, lane.pos - 1)
        self._first_for.pop(lane.state_slot, None)

    def _steps_first(self, packed: torch.Tensor, W: int, k: int, states) -> torch.Tensor:
        """The drafts ``[B, k]`` from the slots' first drafts (packed rows as :meth:`_steps`'s, the
        position that of step 2, ``pos``): draft 1 is the slot's; steps 2..k run from its hidden
        at ``pos .. pos + k - 2`` (provisional K/V) as :meth:`_steps` runs them. Capturable."""
        slots = packed[:, 1]
        tok = self._first_token.index_select(0, slots)[:, None]
        if k == 1:
            return tok
        hid = self._first_hidden.index_select(0, slots)[:, None]
        pos = packed[:, 2:3]
        table = (packed[:, INPUT_COLUMNS:], W)
        steps = [tok]
        for _ in range(1, k):
            logits, g = self._run(tok, hid, pos, (), (), table=table)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            steps.append(tok)
            hid, pos = g, pos + 1
        return torch.cat(steps, 1)

    def _first_rows(self, lanes, pos: Sequence[int], last: Sequence[int]) -> tuple[list[list[int]], int]:
        """:meth:`_steps_first`'s packed rows (step 2 at ``pos``, the table reaching ``last``) and
        their table width."""
        attn = self.mtp.layers[0].self_attn
        table, W = page_rows(attn, self.storage, [l.pages for l in lanes], last, 1)
        return [[0, l.state_slot, p, 0, *row] for l, p, row in zip(lanes, pos, table)], W

    def _propose_first(self, lanes, k: int, states) -> torch.Tensor:
        """:meth:`propose_device` for lanes whose slots hold their first draft. One draft is the
        slots' first drafts as they are: one gather by a slot index kept on the device, with no
        packed rows, copy or graph (the host part of a round at k = 1 is most of its time)."""
        if k == 1:
            return self._first_token.index_select(0, self._slot_index(lanes))[:, None]
        rows, W = self._first_rows(lanes, [l.pos for l in lanes], [max(l.pos + k - 2, 0) for l in lanes])
        if self.graphs is None:
            return self._steps_first(torch.tensor(rows, dtype=torch.long, device=self.model.device), W, k, states)
        return self.graphs.run((*self._key(len(lanes), W, k, states), "first"), self.graphs.pack(rows),
                               lambda p: self._steps_first(p, W, k, states))

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, lanes, k: int, states) -> list[list[int]]:
        return self.propose_device(lanes, k, states).tolist()

    @torch.inference_mode()
    def propose_device(self, lanes, k: int, states) -> torch.Tensor:
        """:meth:`propose`'s drafts ``[B, k]`` left on the device (the k steps and the verify
        pass queue without a wait; a graph's static buffer: read it within the round). Lanes
        whose slots hold their first draft (:meth:`first_drafts`) start from it."""
        if k > 0 and self._has_first(lanes):
            self.proposals_from_first += 1
            return self._propose_first(lanes, k, states)
        if self.graphs is not None:
            return self._propose_packed(lanes, k, states)
        dev = self.model.device
        tables = [l.pages for l in lanes]
        tok = torch.tensor([[l.next_token] for l in lanes], dtype=torch.long, device=dev)
        slots = torch.tensor([l.state_slot for l in lanes], dtype=torch.long, device=dev)
        hid = states.hidden.index_select(0, slots)[:, None]
        pos = torch.tensor([[l.pos - 1] for l in lanes], dtype=torch.long, device=dev)
        # position pos-1 is the bridge: already valid where the prefill had the next token
        write = [(l.backend_frontier or 0) <= l.pos - 1 for l in lanes]
        # the drafts stay on the device until the last step: the k steps queue without a wait
        steps: list[torch.Tensor] = []
        # where the paged decode kernel reads the pages (one query per lane: it reads each lane's
        # own keys only), one page table serves the k steps, wide enough for the last one: one
        # copy to the device instead of one per step and layer (a gathered span stays per step)
        attn = self.mtp.layers[0].self_attn
        table = (page_table(attn, self.storage, tables, [l.pos - 2 + k for l in lanes], 1, dev)
                 if reads_in_place(attn, self.storage, 1) else None)
        for i in range(k):
            logits, g = self._run(tok, hid, pos, [l.pos - 1 + i for l in lanes], tables,
                                  write=write if i == 0 else None, table=table)
            if i == 0:
                for l in lanes:
                    l.backend_frontier = max(l.backend_frontier or 0, l.pos)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            steps.append(tok)
            hid, pos = g, pos + 1
        return torch.cat(steps, 1)

    # ------------------------------------------------------------------ drafting in a graph
    def _steps(self, packed: torch.Tensor, W: int, k: int, states) -> torch.Tensor:
        """The ``k`` draft steps of :meth:`propose` on packed inputs on the device (each lane's
        next token, state slot, position ``pos - 1``, bridge write flag, then its page table of
        width ``W``; :data:`~hpc_cli.speculative.draft_graphs.INPUT_COLUMNS`): the drafts
        ``[B, k]``, computed without reading anything back to the host (capturable)."""
        tok = packed[:, 0:1]
        hid = states.hidden.index_select(0, packed[:, 1])[:, None]
        pos = packed[:, 2:3]
        write = packed[:, 3] != 0
        table = (packed[:, INPUT_COLUMNS:], W)
        steps: list[torch.Tensor] = []
        for i in range(k):
            logits, g = self._run(tok, hid, pos, (), (), write=write if i == 0 else None, table=table)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            steps.append(tok)
            hid, pos = g, pos + 1
        return torch.cat(steps, 1)

    def _propose_packed(self, lanes, k: int, states) -> torch.Tensor:
        """:meth:`propose` through :class:`~hpc_cli.speculative.draft_graphs.DraftGraphs`: the
        round's inputs packed into one pinned host tensor, the steps replayed from a graph."""
        assert self.graphs is not None, "packed proposals need the drafter's graphs"
        attn = self.mtp.layers[0].self_attn
        table, W = page_rows(attn, self.storage, [l.pages for l in lanes], [l.pos - 2 + k for l in lanes], 1)
        # position pos-1 is the bridge: already valid where the prefill had the next token
        packed = self.graphs.pack([[l.next_token, l.state_slot, l.pos - 1, int((l.backend_frontier or 0) <= l.pos - 1),
                                    *row] for l, row in zip(lanes, table)])
        drafts = self.graphs.run(self._key(len(lanes), W, k, states), packed, lambda p: self._steps(p, W, k, states))
        self._bridged(lanes)
        return drafts

    def _key(self, B: int, W: int, k: int, states) -> tuple:
        return DraftGraphs.key(B, W, k, self.storage, states, int(getattr(self.model, "row_block", None) or 0))

    # ------------------------------------------------------------------ the next round's proposal, ahead
    @torch.inference_mode()
    def propose_ahead(self, lanes, k: int, verdict: torch.Tensor, states) -> torch.Tensor | None:
        """The next round's drafts ``[B, k]``, proposed on the device behind this round's verify
        pass and tail (which counted the accepted drafts, caught the MTP K/V up to them and
        computed each lane's bridge and first draft, :meth:`catch_up_and_bridge`), before the host
        reads the verdict: steps 2..k from the slots' first drafts, each lane's position from
        ``verdict`` (:func:`~hpc_cli.speculative.draft_graphs.ahead_inputs`; at ``k = 1`` the
        first draft alone, as a round's own proposal gathers it), so they are the
        drafts :meth:`propose_device` makes after a round whose lanes all stop where the device
        counted (the runtime uses them only then, and calls :meth:`took_ahead`). Its page table
        reaches as far as a round accepting every draft, in the width of one accepting none;
        None where those widths differ or a lane lacks the pages."""
        if k == 1:  # the first draft alone, which no count moves: the proposal at a round's start
            self.proposals_from_first += 1
            return self._propose_first(lanes, 1, states)
        last = [l.pos + 2 * k - 1 for l in lanes]  # the last step's position after k accepted drafts
        if any(len(l.pages) * PAGE_TOKENS <= p for l, p in zip(lanes, last)):
            return None
        # the rows at no accepted draft: step 2 at pos + 1 (then pos + 1 + count)
        pos = [l.pos + 1 for l in lanes]
        rows, W = self._first_rows(lanes, pos, last)
        if self._first_rows(lanes, pos, [p - k for p in last])[1] != W:
            return None
        self.proposals_from_first += 1
        if self.graphs is None:
            packed = torch.tensor(rows, dtype=torch.long, device=self.model.device)
            return self._steps_first(ahead_inputs(packed, verdict), W, k, states)
        return self.graphs.run_ahead((*self._key(len(lanes), W, k, states), "first"), self.graphs.pack(rows),
                                     verdict, lambda p: self._steps_first(p, W, k, states))

    def took_ahead(self, lanes) -> None:
        """A round takes the proposal made ahead for it: its bridge's K/V is written."""
        self._bridged(lanes)

    @staticmethod
    def _bridged(lanes) -> None:
        for l in lanes:
            l.backend_frontier = max(l.backend_frontier or 0, l.pos)

    @torch.inference_mode()
    def warm(self, batches, widths, k: int, states, num_pages: int, max_model_len: int) -> int:
        """Compile and capture the proposal of every ``batches`` x ``widths`` x ``1..k`` drafts
        (a round near ``max_tokens`` drafts fewer) before serving: the engine's warm-up, on its
        worker thread, while the pool holds no cached block (the steps write the MTP K/V of the
        pages they name and read the slots' hidden), twice: from the bridge, and from a tail's
        first drafts (at a round's start, and made ahead for every lanes x width at ``k``).
        Returns the shapes warmed (none without graphs)."""
        if self.graphs is None:
            return 0

        def place(W: int, drafts: int) -> tuple[int, int]:
            last = min(W * PAGE_TOKENS, max_model_len) - 1  # the last step's position
            return max(1, last + 2 - drafts), last // PAGE_TOKENS + 1

        done = warm_proposals(lambda lanes, drafts: self._propose_packed(lanes, drafts, states), batches, widths, k,
                              num_pages, place)
        # the proposals that start from a tail's first drafts, at a round's start and made ahead
        done += warm_proposals(lambda lanes, drafts: self._propose_first(lanes, drafts, states), batches, widths, k,
                               num_pages, place,
                               lambda lanes, drafts: self.propose_ahead(
                                   lanes, drafts, no_draft_accepted(len(lanes), drafts, self.model.device), states))
        self.proposals_from_first = 0
        return done

