"""The transfer engine's records: what a batch names (:class:`RestoreBatch`, block and image
refs), what a plan holds (:class:`CopyOp`, :class:`Mark`), a submitted job (:class:`Job`) and
its handles (:class:`TransferJob`, :class:`RestoreTicket`), and a retired job
(:class:`Completion`). See :mod:`hpc_cli.memory.transfer` for the engine as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

if TYPE_CHECKING:
    from hpc_cli.memory.transfer.engine import TransferEngine
    from hpc_cli.memory.transfer.kernel_plan import KernelPlan

#: ``(main_page, slab)`` or ``(main_page, slab, backend_page)``; the backend page defaults to the main page id
BlockRef = Union[tuple[int, int], tuple[int, int, int]]
#: ``(state_slot, [slab ids])``: the image's packed byte o lives in slabs[o // slab_bytes]
ImageRef = tuple[int, Sequence[int]]


@dataclass(frozen=True, slots=True)
class RestoreBatch:
    """What one admission restores: host-only path blocks, a host-only tail, a host-only image."""

    blocks: Sequence[BlockRef] = ()
    tail: BlockRef | None = None
    image: ImageRef | None = None


@dataclass(slots=True)
class CopyOp:
    """One copy of ``rows`` rows of ``width`` bytes: row ``r`` of the destination starts at byte
    ``dst_off + r * dst_pitch`` of the flat ``uint8`` tensor ``dst`` (likewise the source). Plain
    integers, so planning a batch costs no tensor views; :meth:`views` makes them for CPU copies.
    ``stage`` is 0 for the prelude and ``i + 1`` for model layer ``i``."""

    dst: torch.Tensor
    dst_off: int
    dst_pitch: int
    src: torch.Tensor
    src_off: int
    src_pitch: int
    width: int
    rows: int
    stage: int
    what: tuple

    @property
    def nbytes(self) -> int:
        return self.rows * self.width

    @property
    def tag(self) -> str:
        return " ".join(str(w) for w in self.what)

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, width]`` views of destination and source (torch checks their bounds)."""
        shape = (self.rows, self.width)
        return (self.dst.as_strided(shape, (self.dst_pitch, 1), self.dst.storage_offset() + self.dst_off),
                self.src.as_strided(shape, (self.src_pitch, 1), self.src.storage_offset() + self.src_off))

    def run_cpu(self) -> None:
        d, s = self.views()
        d.copy_(s)


@dataclass(frozen=True, slots=True)
class Mark:
    """An event recorded after every copy of ``stage`` (and of the stages before it)."""

    stage: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A retired job: ``error`` is None when its copies landed."""

    job_id: int
    kind: str  # "restore" or "write"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(eq=False)
class Job:
    """A submitted job: its plan (CopyOps and Marks, or a kernel plan), its events and state."""

    job_id: int
    kind: str
    items: list[CopyOp | Mark]
    stages: int  # 1 + number of model layers
    nbytes: int = 0
    events: dict[int, Any] = field(default_factory=dict)
    final: Any = None
    done: bool = False
    error: str | None = None
    method: str = "dma"
    tables: Any = None  # kernel path: (pinned table, device table), held until retired
    plan: KernelPlan | None = None  # kernel path: planned from the block template (no CopyOps)

    def event_at_or_before(self, stage: int) -> Any:
        best = None
        for s, ev in self.events.items():
            if s <= stage and (best is None or s > best[0]):
                best = (s, ev)
        return None if best is None else best[1]



class TransferJob:
    """The handle of a submitted job. ``done`` once poll() (or drain()) retired it."""

    def __init__(self, engine: "TransferEngine", job: Job) -> None:
        self._engine = engine
        self._job = job

    @property
    def job_id(self) -> int:
        return self._job.job_id

    @property
    def nbytes(self) -> int:
        return self._job.nbytes

    @property
    def done(self) -> bool:
        return self._job.done

    @property
    def error(self) -> str | None:
        return self._job.error

    @property
    def method(self) -> str:
        """How the job's copies moved: ``"dma"`` or ``"kernel"`` (CPU: ``"dma"``, plain copies)."""
        return self._job.method

    def wait_all(self) -> None:
        """Make the compute stream wait for the whole job (CPU: no-op; never blocks the host)."""
        self._engine._wait(self._job, None)


class RestoreTicket(TransferJob):
    """Per-layer readiness of a restore batch for the lane's first prefill pass."""

    def wait_prelude(self) -> None:
        """Compute stream waits for the prelude (tail, backend pages, hidden, backend state)."""
        self._engine._wait(self._job, 0)

    def wait_layer(self, layer: int) -> None:
        """Compute stream waits until model layer ``layer``'s data (and everything before) landed;
        a retired batch has landed, so this is then a no-op."""
        self._engine._wait(self._job, layer + 1)
