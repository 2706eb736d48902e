"""The tail of a speculative round in one CUDA graph: the commit of each lane's state after its
last accepted column, and the drafter's catch-up on the accepted positions.

After the host has read the verify pass and accepted drafts, what is left of a round is device work
whose only new input is each lane's count of accepted drafts: copy the GDN state and conv window
after that column into the lane's slot (:func:`~hpc_cli.speculative.ops.commit_columns`), and, for
a drafter that keeps K/V of its own at committed positions (MTP; DFlash's pool, DFlash2's rings),
write them for the accepted positions (``catch_up_columns``). Issued op by op from Python that is
about a hundred small kernels a round (a millisecond of host time on an H200 host for the 8-layer
model, more than the verify pass's replay); captured, it is one launch.

* The tail reads the verify pass's outputs and index where they are: a graph of the tail is kept
  per verify graph (the key is the verify graph's serial number, ``ColumnsOut.static``, which also
  fixes the pools both write), so a verify graph captured again (another budget, other pools)
  never meets an old tail.
* As with the other graph sets, the first tail of a key runs eagerly and the second captures it;
  a verify pass that ran eagerly (its first pass, graphs off, the CPU) has its tail run eagerly.
  Eager or replayed, the tail runs the same function on the same shapes: the same bits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from hpc_cli.model.columns import ColumnsOut
from hpc_cli.model.graphs import CapturedGraphs
from hpc_cli.model.staging import HostStaging

#: tail graphs kept (least recently used dropped first): one per verify graph in use
MAX_TAILS = 256


@dataclass
class _TailGraph:
    graph: torch.cuda.CUDAGraph
    accepted: torch.Tensor  # the static accepted counts ``[B]``


class RoundTails(CapturedGraphs):
    """The captured tails of one runtime's rounds, keyed by the verify graph they follow."""

    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        super().__init__()
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: OrderedDict[tuple, _TailGraph] = OrderedDict()
        self.seen: set[tuple] = set()
        self.staging = HostStaging(device)

    def run(self, out: ColumnsOut, accepted: list[int], variant: str,
            tail: Callable[[ColumnsOut, torch.Tensor], None]) -> None:
        """``tail(out, accepted)`` with the counts on the device: from a graph where ``out`` is a
        verify graph's static output seen before with this ``variant`` of the tail (the same
        verify graph can be followed by the commit alone or by the commit and the drafter's
        catch-up), else eagerly."""
        counts = self.staging.stage(accepted)
        if not (self.use_graphs and out.static and self.disabled is None):
            tail(out, self.staging.send(counts))
            return
        key = (out.static, variant)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
        elif key in self.seen:
            static = counts.to(self.device)  # a copy the host waits for
            captured = self.try_capture(lambda: tail(out, static), "committing the round")
            if captured is not None:
                entry = _TailGraph(captured[0], static)
                self.graphs[key] = entry
                while len(self.graphs) > MAX_TAILS:
                    self.graphs.popitem(last=False)
        if entry is None:
            if len(self.seen) > 4 * MAX_TAILS:
                self.seen.clear()
            self.seen.add(key)
            tail(out, self.staging.send(counts))
            return
        self.staging.send_into(counts, entry.accepted)
        entry.graph.replay()
        self.replays += 1
