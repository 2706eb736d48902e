"""CUDA graphs of a drafter's proposal: MTP's ``k`` draft steps, or DFlash's block forward,
replayed as one launch.

A drafter step is a few dozen small kernels (the MTP head: embedding, the combining projection,
one attention layer, its MLP, the norm, ``lm_head``, the argmax; a DFlash block: its layers over
the gathered context, ``lm_head``, DFlash2's selector); launched one by one from Python a round's
proposal costs more host time than the verify pass that checks it. As the column pass's graphs do
(:mod:`hpc_cli.model.graphs`), one graph per ``(lanes, page table width, k)`` serves every round:
the round's inputs (per lane its next token, state slot, position, one drafter-specific column
(MTP: whether the step writes the bridge's K/V), and its page table) are packed into one host
tensor and copied into the graph's static buffer before the replay.

* The first proposal of a key runs the same steps eagerly on the packed inputs (it compiles the
  Triton kernels); the second captures them and replays, so a captured proposal computes what the
  eager one does, bit for bit.
* Graphs bake in the pools' storage (the KV pool, the state slots) and the NVFP4 global scales;
  the key carries their serials and values, so other pools never replay an old graph.
* A failed capture turns the graphs off for the drafter, with one warning
  (:meth:`~hpc_cli.model.graphs.CapturedGraphs.try_capture`); proposals run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hpc_cli.model.graphs import CapturedGraphs, pool_serials
from hpc_cli.model.staging import HostStaging
from hpc_cli.speculative.round_tail import greedy_counts

#: columns of a packed input row before the page table: next token, state slot, position, write
INPUT_COLUMNS = 4


def ahead_inputs(packed: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor:
    """The packed inputs of the round after a greedy round, on the device (capturable): ``packed``
    holds each lane's row as it is with no draft accepted (its next token a placeholder), and
    ``verdict`` ``[B, 2k + 1]`` is the round's verify pass's (its drafts, then every column's
    argmax). Each lane's next token becomes the argmax at its count of accepted drafts
    (:func:`~hpc_cli.speculative.round_tail.greedy_counts`) and its position moves on by that
    count."""
    k = (verdict.shape[1] - 1) // 2
    counts = greedy_counts(verdict)[:, None]
    return torch.cat([verdict[:, k:].gather(1, counts), packed[:, 1:2], packed[:, 2:3] + counts, packed[:, 3:]], 1)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static packed inputs ``[B, INPUT_COLUMNS + W]``
    drafts: torch.Tensor  # the static drafts ``[B, k]``
    verdict: torch.Tensor | None = None  # a proposal ahead's static verdict ``[B, 2k + 1]``


class DraftGraphs(CapturedGraphs):
    """The captured proposals of one drafter, keyed by lanes, table width and ``k``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.graphs: dict[tuple, _DraftGraph] = {}
        self.seen: set[tuple] = set()
        self.staging = HostStaging(device)

    def pack(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """A round's packed inputs ``[B, INPUT_COLUMNS + W]`` (one row a lane, of equal lengths) in
        a staged host buffer (pinned on CUDA), for :meth:`run`."""
        return self.staging.stage([v for row in rows for v in row]).view(len(rows), -1)

    @staticmethod
    def key(B: int, W: int, k: int, kv, states, row_block: int) -> tuple:
        """What a graph bakes in: the shape, the pools' serials, the NVFP4 global scales."""
        scales = tuple(kv.global_scales.flatten().tolist()) if kv.profile.uses_global_scale else ()
        return (B, W, k, pool_serials(kv, states), scales, row_block)

    def run(self, key: tuple, packed: torch.Tensor, steps: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The drafts ``[B, k]`` of ``steps`` (a function of the packed inputs on the device) on
        ``packed`` (from :meth:`pack`): eagerly the first time a key is met, then from its graph.
        A graph's result is its static buffer: read it before the next proposal of the key."""
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and self.disabled is None:
            entry = self._capture(key, packed, steps)
        if entry is None:
            self.seen.add(key)
            return steps(self.staging.send(packed))
        self.staging.send_into(packed, entry.inputs)
        entry.graph.replay()
        self.replays += 1
        return entry.drafts

    def run_ahead(self, key: tuple, packed: torch.Tensor, verdict: torch.Tensor,
                  steps: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """:meth:`run` for a proposal ahead: ``steps`` of :func:`ahead_inputs` of ``packed`` (the
        rows at no accepted draft) and the round's ``verdict`` on the device, which a graph takes
        into a static buffer of its own (a device copy)."""
        key = (*key, "ahead")
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and self.disabled is None:
            entry = self._capture(key, packed, steps, verdict)
        if entry is None:
            self.seen.add(key)
            return steps(ahead_inputs(self.staging.send(packed), verdict))
        self.staging.send_into(packed, entry.inputs)
        assert entry.verdict is not None, "a proposal ahead's graph has a verdict buffer"
        entry.verdict.copy_(verdict)
        entry.graph.replay()
        self.replays += 1
        return entry.drafts

    def _capture(self, key: tuple, packed: torch.Tensor, steps: Callable[[torch.Tensor], torch.Tensor],
                 verdict: torch.Tensor | None = None) -> _DraftGraph | None:
        static = packed.to(self.device)  # a copy the host waits for
        held = verdict.clone() if verdict is not None else None
        captured = self.try_capture(lambda: steps(static if held is None else ahead_inputs(static, held)),
                                    "proposing")
        if captured is None:
            return None
        graph, drafts = captured
        entry = _DraftGraph(graph, static, drafts, held)
        self.graphs[key] = entry
        return entry


class WarmLane:
    """What a proposal reads of a lane, for the warm-up's shapes (a drafter's ``warm``)."""

    def __init__(self, next_token: int, state_slot: int, pos: int, pages: list[int]) -> None:
        self.next_token, self.state_slot, self.pos, self.pages = next_token, state_slot, pos, pages
        self.backend_frontier = 0


def no_draft_accepted(B: int, k: int, device: torch.device) -> torch.Tensor:
    """A verify verdict ``[B, 2k + 1]`` in which no lane accepts a draft (a warm-up's)."""
    return torch.cat([torch.zeros(B, k, dtype=torch.long, device=device),
                      torch.ones(B, k + 1, dtype=torch.long, device=device)], 1)


def warm_proposals(propose: Callable[[list[WarmLane], int], object], batches: Sequence[int], widths: Sequence[int],
                   k: int, num_pages: int, place: Callable[[int, int], tuple[int, int]],
                   ahead: Callable[[list[WarmLane], int], object] | None = None) -> int:
    """A drafter's warm-up: ``propose(lanes, drafts)`` twice (eager, then the capture of its graph)
    for every lanes x table width x ``1..k`` drafts (a round near ``max_tokens`` drafts fewer);
    ``place(width, drafts)`` gives the warm lanes' position and their pages (each lane its own,
    modulo ``num_pages``). ``ahead(lanes, k)``: the proposal ahead of every lanes x width, from lanes
    ``k + 1`` positions before (its table reaches as far as the round after a round that accepts
    every draft). Returns the shapes warmed."""
    done = 0
    for B in batches:
        for W in widths:
            for drafts in range(1, k + 1):
                pos, need = place(W, drafts)
                lanes = [WarmLane(1 + b, b, pos, [(b * need + i) % num_pages for i in range(need)]) for b in range(B)]
                for _ in range(2):
                    propose(lanes, drafts)
                    if ahead is not None and drafts == k:
                        for lane in lanes:
                            lane.pos = max(1, pos - k - 1)
                        ahead(lanes, k)
                        for lane in lanes:
                            lane.pos = pos
                done += 1
    return done
