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
* Greedy counts on the device: where every lane of the round decodes greedily the counts are the
  drafts matched before the first mismatch, which the tail computes from the verify pass's verdict
  itself (:func:`greedy_counts`). The runtime then launches the tail right behind the verify pass,
  before it reads the verdict: the device runs both back to back, with no copy of counts and no
  wait for the host's accepting between them. A lane the host stops earlier (a stop token inside
  the accepted drafts) has its commit run again with the host's count
  (:meth:`~hpc_cli.speculative.runtime.SpecRuntime`'s round does it).
* As with the other graph sets, the first tail of a key runs eagerly and the second captures it;
  a verify pass that ran eagerly (its first pass, graphs off, the CPU) has its tail run eagerly.
  On the CPU MTP's rounds take the tail too (``RoundTails.batched``), eagerly: the bridge in the
  catch-up's pass costs fewer ops than the lane-by-lane catch-up and the bridge's own step.
  Eager or replayed, the tail runs the same function on the same shapes: the same bits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from hpc_cli.model.columns import ColumnsOut
from hpc_cli.model.graphs import MAX_GRAPHS, CapturedGraphs
from hpc_cli.model.staging import HostStaging

#: tail graphs kept (least recently used dropped first): one per verify graph kept, for each
#: variant (the commit alone, with the catch-up) and each way of counting (the host's counts, the
#: greedy ones on the device)
MAX_TAILS = 4 * MAX_GRAPHS


def greedy_counts(verdict: torch.Tensor) -> torch.Tensor:
    """Per lane the drafts a greedy round accepts, on the device: of a verify pass's verdict ``[B,
    2T - 1]`` (the drafts, then every column's argmax) the drafts equal to the argmax before the
    first that is not, ``[B]`` int64 (capturable: no host read)."""
    k = (verdict.shape[1] - 1) // 2
    matches = verdict[:, :k] == verdict[:, k:2 * k]
    if k == 1:
        return matches.sum(1)  # a bool's sum is int64: two launches
    return matches.cumprod(1).sum(1)  # a bool's running product is int64


@dataclass
class _TailGraph:
    graph: torch.cuda.CUDAGraph
    accepted: torch.Tensor | None  # the static accepted counts ``[B]`` (None: counted on the device)
    result: object  # what the tail returned (a drafter's saved values), static


class RoundTails(CapturedGraphs):
    """The captured tails of one runtime's rounds, keyed by the verify graph they follow."""

    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        super().__init__()
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        #: whether rounds run their tail as one call for every lane (commit, catch-up, greedy counts
        #: on the device): where it is captured; elsewhere the runtime turns it on for a drafter
        #: whose tail saves it a step (MTP's bridge, on the CPU); else lanes catch up one by one,
        #: skipping the lanes that accepted nothing
        self.batched = self.use_graphs
        self.graphs: OrderedDict[tuple, _TailGraph] = OrderedDict()
        self.seen: set[tuple] = set()
        self.staging = HostStaging(device)
        self._reads: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}  # pinned, by shape
        self._read_done = torch.cuda.Event() if device.type == "cuda" else None

    def read_later(self, t: torch.Tensor) -> Callable[[], list]:
        """``t.tolist()``, its copy to the host queued behind the work queued so far: the call
        returned waits for that copy alone, not for work queued after it (a proposal ahead).
        One read at a time: call it before the next :meth:`read_later`."""
        if self._read_done is None:
            values = t.tolist()
            return lambda: values
        key = (tuple(t.shape), t.dtype)
        buf = self._reads.get(key)
        if buf is None:
            buf = self._reads[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        done = self._read_done
        self.staging.record(done)  # on the rounds' stream

        def wait() -> list:
            done.synchronize()
            return buf.tolist()

        return wait

    def run(self, out: ColumnsOut, accepted: list[int] | None, variant: str,
            tail: Callable[[ColumnsOut, torch.Tensor], object]) -> object:
        """``tail(out, accepted)`` with the counts on the device: from a graph where ``out`` is a
        verify graph's static output seen before with this ``variant`` of the tail (the same
        verify graph can be followed by the commit alone or by the commit and the drafter's
        catch-up), else eagerly. ``accepted`` None: the greedy counts of ``out``'s verdict,
        computed on the device (:func:`greedy_counts`). Returns what ``tail`` returned (a graph's
        static result: read it before the tail's next run)."""
        on_device = accepted is None
        counts = None if on_device else self.staging.stage(accepted)

        def device_counts() -> torch.Tensor:
            assert out.verdict is not None, "greedy counts need the verify pass's verdict"
            return greedy_counts(out.verdict)

        if not (self.use_graphs and out.static and self.disabled is None):
            return tail(out, device_counts() if on_device else self.staging.send(counts))
        key = (out.static, variant, on_device)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
        elif key in self.seen:
            static = None if on_device else counts.to(self.device)  # a copy the host waits for
            captured = self.try_capture(lambda: tail(out, device_counts() if on_device else static),
                                        "committing the round")
            if captured is not None:
                entry = _TailGraph(captured[0], static, captured[1])
                self.graphs[key] = entry
                while len(self.graphs) > MAX_TAILS:
                    self.graphs.popitem(last=False)
        if entry is None:
            if len(self.seen) > 4 * MAX_TAILS:
                self.seen.clear()
            self.seen.add(key)
            return tail(out, device_counts() if on_device else self.staging.send(counts))
        if entry.accepted is not None:
            self.staging.send_into(counts, entry.accepted)
        entry.graph.replay()
        self.replays += 1
        return entry.result
