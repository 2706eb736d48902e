"""The transfer engine: restores (host -> device) and write-through (device -> host), batched
into strided runs (spec §6.4-6.5, §7.4, §7.6-7.7, §11.1-11.2; ARCHITECTURE.md §5).

A *restore batch* (:class:`RestoreBatch`) is enqueued on the restore stream in the order a forward
pass reads it, as *stages*:

* stage 0, the prelude: the snapshot tail bundle (every main layer and the backend page), every
  restored block's backend page and main layers that are not model layers (MTP's extra layer),
  and the image's continuation hidden and backend parts;
* stage ``i + 1`` for model layer ``i`` of ``layer_order``: an attention layer's KV planes of every
  restored block, or a GDN layer's conv and recurrent state;

with an event after each stage that copied something. :meth:`RestoreTicket.wait_layer` makes the
compute stream wait for the latest event at or before that layer's stage. The restore stream first
waits for the compute stream's queued work (destinations may have been read by earlier kernels);
write-through runs on its own stream after the compute stream's queued work (the data must be
written first). Each stream completes its jobs in order; :meth:`TransferEngine.poll` retires
finished jobs and never blocks.

Copies: the ``(page, slab)`` pairs are grouped by :func:`plan_runs` and every run moves as ONE
copy per (layer, plane): ``cudaMemcpy2DAsync`` through cuda-python (``cuda.bindings.runtime`` or
the older ``cuda.cudart``) when it is installed, otherwise one torch copy when both sides are
contiguous and one per row when not (torch's copy of a strided host view stages it through a
pageable buffer). Image parts move as one copy per part piece (pieces split only where the image
crosses into a non-adjacent slab).

Copy method, chosen per job (``copy_method``: ``"auto"``, ``"dma"``, ``"kernel"``; default the
environment variable ``HPC_TRANSFER_COPY``, else ``"auto"``): ``"dma"`` is the copies above, on the
copy engines; ``"kernel"`` moves the job's copies with the batched segment copy kernel
(``hpc_kernels.seg_copy``: one launch copies a table of ``(src, dst, bytes)`` rows, reading and
writing pinned host slabs at their mapped addresses). A separate copy costs ~10 us in the driver,
so a job of many small copies (one 2 MiB block bundle is 64 of them) is bound by the calls; the
kernel takes one launch. ``"auto"`` uses the kernel when the job's bytes per DMA call are below
``kernel_max_call_bytes`` (1 MiB) and the DMA copies otherwise (big runs already reach ~0.95 of a
contiguous copy on the copy engines and leave the SMs to the model). The kernel path keeps the
stages: consecutive stages are joined into one launch until it holds ``kernel_launch_bytes`` (8
MiB), and one event is recorded after each launch and shared by every stage it holds (a 1-block
restore is one launch, then one event for all its stages). The row table is built on the host and
written to a pinned buffer that the kernel reads (or that is copied to the device on the job's
stream first; no device sync); both buffers stay with the job until it retires, then serve later
jobs. A blocks-only kernel job (restore blocks without tail or image; write-through blocks and
tails without images) is planned without CopyOps: its table is a per-engine *block template* (the
rows of one bundle at page 0 / slab 0, with per-row page and slab multipliers) broadcast over the
job's blocks (:meth:`TransferEngine.plan_kernel_blocks`), the same launches and rows as
``plan_kernel`` of the general plan.

On CPU the copies run at once and every job is complete when submitted. :class:`FakeTransferEngine`
records the operations in order and copies only when told (:meth:`~FakeTransferEngine.complete`),
and can fail a job, so Filling and pin rules are tested on CPU.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import numpy as np
import torch

from hpc_cli.errors import EngineError
from hpc_cli.memory.host_slabs import DEFAULT_MAX_PITCH, BundleLayout, HostSlabStorage, Run, plan_runs
from hpc_cli.memory.cudart import load_cudart
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots

#: ``(main_page, slab)`` or ``(main_page, slab, backend_page)``; the backend page defaults to the main page id
BlockRef = Union[tuple[int, int], tuple[int, int, int]]
#: ``(state_slot, [slab ids])``: the image's packed byte o lives in slabs[o // slab_bytes]
ImageRef = tuple[int, Sequence[int]]

COPY_METHODS = ("auto", "dma", "kernel")
COPY_ENV = "HPC_TRANSFER_COPY"
KERNEL_MAX_CALL_BYTES = 1 << 20
KERNEL_LAUNCH_BYTES = 8 << 20


def copy_method_from_env(value: str | None = None) -> str:
    """``value``, else ``$HPC_TRANSFER_COPY``, else ``"auto"``; checked against :data:`COPY_METHODS`."""
    method = (value if value is not None else os.environ.get(COPY_ENV, "") or "auto").strip().lower()
    if method not in COPY_METHODS:
        source = "the argument" if value is not None else COPY_ENV
        raise EngineError(f"unknown transfer copy method {method!r} (from {source})",
                          hint=f"use one of {', '.join(COPY_METHODS)}")
    return method


def _seg_copy():
    from hpc_kernels import seg_copy

    return seg_copy


def layer_order_for_shape(shape) -> list[tuple[str, int]]:
    """Model layers in forward order as ``("attn", a)`` / ``("gdn", g)`` with per-kind indices."""
    out, a, g = [], 0, 0
    for i in range(shape.num_layers):
        if (i + 1) % shape.full_attention_interval == 0:
            out.append(("attn", a))
            a += 1
        else:
            out.append(("gdn", g))
            g += 1
    return out


# -- records -----------------------------------------------------------------------------------
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
class KernelLaunch:
    """One launch of the segment copy kernel over rows ``row0..row1`` of a job's table (the
    first ``n_wide`` of them wide), then an event for each of ``stages``."""

    row0: int
    row1: int
    n_wide: int
    stages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """A job's row table (``int64 [rows, 4]``: src, dst, bytes, 0) and its launches in order."""

    table: np.ndarray
    launches: tuple[KernelLaunch, ...]


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
class _Job:
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


@dataclass(frozen=True, slots=True)
class _BlockTemplate:
    """The kernel rows of ONE block bundle (page 0, backend page 0, slab 0) of a restore or a
    write-through, with per-row multipliers: row ``r``'s host-side address is ``host[r]`` plus
    the slab's offset from slab 0 (``slab_bytes`` per slab within a chunk), its device-side
    address ``dev[r] + page * main_ppb[r] + backend_page * back_ppb[r]`` (one of the two is the
    plane's page bytes, the other 0); src is the host side for a restore, dst for a write. Rows
    are wide rows in stage order, then narrow rows in stage order; stage ``stages[k]``'s wide
    rows are ``wide[k]..wide[k + 1]``, its narrow rows ``n_wide + narrow[k]..n_wide + narrow[k + 1]``."""

    to_host: bool
    stages: tuple[int, ...]  # stages with copies (each gets a Mark in the general plan)
    stage_bytes: tuple[int, ...]  # bytes one block moves in each of them
    wide: tuple[int, ...]
    narrow: tuple[int, ...]
    host: np.ndarray  # int64 [rows]
    dev: np.ndarray
    main_ppb: np.ndarray
    back_ppb: np.ndarray
    nbytes: np.ndarray
    base: np.ndarray  # int64 [rows, 1, 4]: the rows of the block at page 0, slab 0
    dev_ppb: np.ndarray  # int64 [rows, 1]: main_ppb + back_ppb (a block's pages all equal)
    n_wide: int
    has_backend: bool
    ops: int  # (layer, plane) copies per block: the fewest DMA calls a job of blocks can take
    block_bytes: int


class TransferJob:
    """The handle of a submitted job. ``done`` once poll() (or drain()) retired it."""

    def __init__(self, engine: "TransferEngine", job: _Job) -> None:
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


# -- the engine --------------------------------------------------------------------------------
class TransferEngine:
    """Restores and write-through between device pools/state slots and host slabs.

    ``main``: the main KV pool's storage; ``backend``: a backend's own pool (DFlash) or None;
    ``state``: the state slots (images) or None; ``layer_order``: model layers in forward order
    (:func:`layer_order_for_shape`), default all attention layers then all GDN layers; main KV
    layers not named there (MTP's extra layer) are copied in the prelude. ``copy_method``,
    ``kernel_max_call_bytes`` and ``kernel_launch_bytes``: see the module doc (CUDA only; CPU
    copies are plain copies whatever the method).
    """

    def __init__(self, main: PagedKVStorage, host: HostSlabStorage, *, state: StateSlots | None = None,
                 backend: PagedKVStorage | None = None,
                 layer_order: Sequence[tuple[str, int]] | None = None,
                 use_cuda_python: bool = True, copy_method: str | None = None,
                 kernel_max_call_bytes: int = KERNEL_MAX_CALL_BYTES,
                 kernel_launch_bytes: int = KERNEL_LAUNCH_BYTES) -> None:
        self.main = main
        self.backend = backend
        self.state = state
        self.host = host
        self.layout = BundleLayout.for_storage(main, backend)
        assert self.layout.slab_bytes <= host.slab_bytes, \
            f"bundle of {self.layout.slab_bytes} B does not fit a {host.slab_bytes} B slab"
        n_gdn = state.num_gdn_layers if state is not None else 0
        if layer_order is None:
            layer_order = [("attn", a) for a in range(main.num_layers)] + [("gdn", g) for g in range(n_gdn)]
        self.layer_order = list(layer_order)
        for kind, idx in self.layer_order:
            assert (kind == "attn" and 0 <= idx < main.num_layers) or (kind == "gdn" and 0 <= idx < n_gdn), \
                f"layer_order names {kind} {idx}, which this engine does not hold"
        named = {idx for kind, idx in self.layer_order if kind == "attn"}
        self.prelude_main_layers = [a for a in range(main.num_layers) if a not in named]
        self.device = main.device
        # flat byte views the copies address: per layer per plane, per image part
        self._main_bases = [[p.view(-1) for p in layer] for layer in main.planes]
        self._back_bases = [[p.view(-1) for p in layer] for layer in backend.planes] if backend else []
        self._image_groups: dict[int | None, list[tuple[str, torch.Tensor, int, int]]] = {}
        if state is not None:
            off = 0
            for name, g, part in state.image_parts():
                assert part.is_contiguous(), f"state part {name} must be contiguous"
                slot_bytes = part[0].numel() * part.element_size()
                base = part.reshape(-1).view(torch.uint8)
                self._image_groups.setdefault(g, []).append((name, base, slot_bytes, off))
                off += slot_bytes
            assert off == state.image_bytes, f"image parts sum to {off} B, image_bytes is {state.image_bytes}"
        self._image_slabs = -(-state.image_bytes // host.slab_bytes) if state is not None else 0
        self._ids = itertools.count(1)
        self._queues: dict[str, deque[_Job]] = {"restore": deque(), "write": deque()}
        self._retired: list[Completion] = []
        self.cudart = None
        self.max_pitch = DEFAULT_MAX_PITCH
        self._streams: dict[str, Any] = {}
        self._event_pool: list[Any] = []
        self.copy_method = copy_method_from_env(copy_method)
        self.kernel_max_call_bytes = kernel_max_call_bytes
        self.kernel_launch_bytes = kernel_launch_bytes
        # addresses the kernel uses for host chunks (their mapped device addresses)
        self._kernel_addr = {c.data_ptr(): d for c, d in zip(host.chunks, host.device_ptrs) if d is not None}
        # the kernel address of every base tensor a CopyOp names, by id (the engine holds them all)
        self._base_addr = {id(t): self._kernel_addr.get(t.data_ptr(), t.data_ptr()) for t in
                           [*host.chunks, *(p for layer in self._main_bases for p in layer),
                            *(p for layer in self._back_bases for p in layer),
                            *(b for group in self._image_groups.values() for _, b, _, _ in group)]}
        self._table_pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._templates: dict[str, _BlockTemplate | None] = {}  # per job kind, built on first use
        # bounds of a block ref's (page, slab, backend page), for the fast planner's range check
        self._ref_limits = np.array([main.num_pages, host.num_slabs,
                                     backend.num_pages if backend is not None else 1 << 63], dtype=np.uint64)
        #: the kernel reads its row table from pinned host memory (mapped) instead of uploading
        #: it first: a 1-block restore went from 0.82 to 0.92 of a contiguous copy on an H200
        #: (``HPC_SEG_TABLE_HOST=0`` uploads it, as before; docs/memory.md)
        self.table_on_host = os.environ.get("HPC_SEG_TABLE_HOST", "1") != "0"
        self.kernel_ok = False
        self.kernel_unavailable: str | None = "CPU copies are plain copies"  # why kernel_ok is False
        if self.device.type == "cuda":
            self.cudart = load_cudart() if use_cuda_python else None
            self._streams = {"restore": torch.cuda.Stream(self.device), "write": torch.cuda.Stream(self.device)}
            if self.cudart is not None:
                rt = self.cudart
                err, val = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMaxPitch,
                                                     self.device.index or 0)
                if int(err) == 0:
                    self.max_pitch = int(val)
            why = self.kernel_unavailable = "the copy method is dma" if self.copy_method == "dma" \
                else self._why_no_kernel()
            self.kernel_ok = why is None
            if self.copy_method == "kernel" and why is not None:
                raise EngineError(f"transfer copy method 'kernel' cannot run here: {why}",
                                  hint=f"set {COPY_ENV}=auto or dma")

    def _why_no_kernel(self) -> str | None:
        if self.host.num_slabs and not self.host.pinned:
            return "the host slabs are not pinned"
        if any(d is None for d in self.host.device_ptrs):
            return "a host chunk is not mapped into the device's address space"
        return _seg_copy().probe(self.device)

    # -- public API -------------------------------------------------------------------------
    @property
    def uses_2d_copies(self) -> bool:
        return self.cudart is not None

    def restore(self, batch: RestoreBatch) -> RestoreTicket:
        """Enqueue a restore batch in forward-pass order; returns at once with its ticket."""
        job = self._restore_job(batch)
        self._submit(job)
        return RestoreTicket(self, job)

    def write_through(self, blocks: Sequence[BlockRef] = (), images: Sequence[ImageRef] = (),
                      tails: Sequence[BlockRef] = ()) -> TransferJob:
        """Enqueue one write-through batch (a lane's blocks at release, published images and
        tails) on the write-through stream; returns at once."""
        job = self._write_job(blocks, images, tails)
        self._submit(job)
        return TransferJob(self, job)

    def _restore_job(self, batch: RestoreBatch) -> _Job:
        """The job of a restore batch: from the block template when it is a blocks-only kernel
        job (CUDA), else from :meth:`plan_restore`."""
        if batch.tail is None and batch.image is None and batch.blocks:
            job = self._fast_job("restore", batch.blocks)
            if job is not None:
                return job
        return self._new_job("restore", self.plan_restore(batch))

    def _write_job(self, blocks: Sequence[BlockRef], images: Sequence[ImageRef], tails: Sequence[BlockRef]) -> _Job:
        """The job of a write-through batch (tails are blocks here; see :meth:`_restore_job`)."""
        if not images and (blocks or tails):
            job = self._fast_job("write", [*blocks, *tails] if tails else blocks)
            if job is not None:
                return job
        return self._new_job("write", self.plan_write(blocks, images, tails))

    def poll(self) -> list[Completion]:
        """Retire every job whose copies finished (in order per stream); never blocks."""
        for q in self._queues.values():
            while q and self._finished(q[0]):
                self._retire(q.popleft())
        out, self._retired = self._retired, []
        return out

    def drain(self) -> list[Completion]:
        """Wait for every queued job, then retire them all."""
        for s in self._streams.values():
            s.synchronize()
        return self.poll()

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    # -- planning ---------------------------------------------------------------------------
    def _runs(self, pairs: list[tuple[int, int]], pool: PagedKVStorage) -> list[Run]:
        return plan_runs(pairs, slab_bytes=self.host.slab_bytes, slabs_per_chunk=self.host.slabs_per_chunk,
                         page_bytes=max(pool.plane_page_bytes), max_pitch=self.max_pitch)

    def _kv_ops(self, runs: list[Run], pool: PagedKVStorage, backend: bool, layer: int, stage: int,
                to_host: bool, out: list) -> None:
        ppbs = pool.plane_page_bytes
        bases = (self._back_bases if backend else self._main_bases)[layer]
        host = self.host
        sb, spc = host.slab_bytes, host.slabs_per_chunk
        for r in runs:
            last_page = r.page0 + (r.count - 1) * r.page_stride
            last_slab = r.slab0 + (r.count - 1) * r.slab_stride
            assert 0 <= r.page0 and last_page < pool.num_pages, \
                f"pool {pool.name}: pages {r.page0}..{last_page} outside 0..{pool.num_pages - 1}"
            assert 0 <= r.slab0 and last_slab < host.num_slabs, \
                f"slabs {r.slab0}..{last_slab} outside 0..{host.num_slabs - 1}"
            c = r.slab0 // spc
            assert last_slab // spc == c, f"run of slabs {r.slab0}..{last_slab} crosses a chunk"
            chunk = host.chunks[c]
            hoff0 = (r.slab0 % spc) * sb
            hpitch = r.slab_stride * sb
            for j, dev in enumerate(bases):
                ppb = ppbs[j]
                hoff = hoff0 + (self.layout.backend_plane_offset(layer, j) if backend
                                else self.layout.main_offset(layer, j))
                what = ("backend" if backend else "main", f"L{layer}", pool.layout.planes[j].name,
                        f"p{r.page0}x{r.count}")
                doff, dpitch = r.page0 * ppb, r.page_stride * ppb
                if to_host:
                    out.append(CopyOp(chunk, hoff, hpitch, dev, doff, dpitch, ppb, r.count, stage, what))
                else:
                    out.append(CopyOp(dev, doff, dpitch, chunk, hoff, hpitch, ppb, r.count, stage, what))

    def _image_ops(self, slot: int, slabs: Sequence[int], gdn: int | None, stage: int, to_host: bool,
                   out: list) -> None:
        assert self.state is not None, "this engine holds no state slots"
        assert 0 <= slot < self.state.num_slots, f"state slot {slot} outside 0..{self.state.num_slots - 1}"
        need = self._image_slabs
        assert len(slabs) >= need, f"image of {self.state.image_bytes} B needs {need} slabs, got {len(slabs)}"
        chunks = self.host.chunks
        for name, base, slot_bytes, off in self._image_groups.get(gdn, ()):
            dbase = slot * slot_bytes
            for c, hoff, n, o in self.host.image_extents(slabs, off, slot_bytes):
                doff = dbase + o - off
                what = ("image", name, f"slot{slot}", f"@{o}")
                if to_host:
                    out.append(CopyOp(chunks[c], hoff, n, base, doff, n, n, 1, stage, what))
                else:
                    out.append(CopyOp(base, doff, n, chunks[c], hoff, n, n, 1, stage, what))

    def _split(self, blocks: Sequence[BlockRef]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        main = [(b[0], b[1]) for b in blocks]
        back = [(b[2] if len(b) > 2 else b[0], b[1]) for b in blocks]
        return main, back

    def plan_restore(self, batch: RestoreBatch) -> list[CopyOp | Mark]:
        """The copies and marks of a restore batch, in forward-pass order (see module doc)."""
        items: list[CopyOp | Mark] = []
        main_pairs, back_pairs = self._split(batch.blocks)
        main_runs = self._runs(main_pairs, self.main) if main_pairs else []
        # stage 0: the prelude
        if batch.tail is not None:
            (tm, tb) = self._split([batch.tail])
            truns = self._runs(tm, self.main)
            for layer in range(self.main.num_layers):
                self._kv_ops(truns, self.main, False, layer, 0, False, items)
            if self.backend is not None:
                bruns = self._runs(tb, self.backend)
                for layer in range(self.backend.num_layers):
                    self._kv_ops(bruns, self.backend, True, layer, 0, False, items)
        if self.backend is not None and back_pairs:
            bruns = self._runs(back_pairs, self.backend)
            for layer in range(self.backend.num_layers):
                self._kv_ops(bruns, self.backend, True, layer, 0, False, items)
        for layer in self.prelude_main_layers:
            self._kv_ops(main_runs, self.main, False, layer, 0, False, items)
        if batch.image is not None:
            self._image_ops(batch.image[0], batch.image[1], None, 0, False, items)
        if items:
            items.append(Mark(0))
        # stages 1..: one per model layer
        for i, (kind, idx) in enumerate(self.layer_order):
            n = len(items)
            if kind == "attn":
                self._kv_ops(main_runs, self.main, False, idx, i + 1, False, items)
            elif batch.image is not None:
                self._image_ops(batch.image[0], batch.image[1], idx, i + 1, False, items)
            if len(items) > n:
                items.append(Mark(i + 1))
        return items

    def plan_write(self, blocks: Sequence[BlockRef] = (), images: Sequence[ImageRef] = (),
                   tails: Sequence[BlockRef] = ()) -> list[CopyOp | Mark]:
        """The copies of a write-through batch (blocks and tails in runs, then images)."""
        items: list[CopyOp | Mark] = []
        main_pairs, back_pairs = self._split([*blocks, *tails])
        if main_pairs:
            runs = self._runs(main_pairs, self.main)
            for layer in range(self.main.num_layers):
                self._kv_ops(runs, self.main, False, layer, 0, True, items)
            if self.backend is not None:
                bruns = self._runs(back_pairs, self.backend)
                for layer in range(self.backend.num_layers):
                    self._kv_ops(bruns, self.backend, True, layer, 0, True, items)
        for slot, slabs in images:
            self._image_ops(slot, slabs, None, 0, True, items)
            for g in range(self.state.num_gdn_layers if self.state is not None else 0):
                self._image_ops(slot, slabs, g, 0, True, items)
        items.append(Mark(0))
        return items

    # -- the kernel path ----------------------------------------------------------------------
    def _dma_calls(self, op: CopyOp) -> int:
        flat = op.rows == 1 or (op.dst_pitch == op.width and op.src_pitch == op.width)
        return 1 if (flat or self.cudart is not None) else op.rows

    def choose_method(self, items: Sequence[CopyOp | Mark]) -> str:
        """``"kernel"`` or ``"dma"`` for a job of these items (see the module doc)."""
        if not self.kernel_ok:
            return "dma"
        if self.copy_method == "kernel":
            return "kernel"
        calls = nbytes = 0
        for op in items:
            if isinstance(op, CopyOp):
                calls += self._dma_calls(op)
                nbytes += op.nbytes
        return "kernel" if calls and nbytes < calls * self.kernel_max_call_bytes else "dma"

    def _segments(self, ops: Sequence[CopyOp]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, nbytes, op index)`` of every row the ops move, at kernel addresses (the
        rows of a copy with both sides packed become one segment)."""
        addr = self._base_addr

        def base(t: torch.Tensor) -> int:
            a = addr.get(id(t))
            if a is None:
                a = self._kernel_addr.get(t.data_ptr(), t.data_ptr())
            return a

        a = np.array([(base(op.src) + op.src_off, op.src_pitch, base(op.dst) + op.dst_off, op.dst_pitch,
                       op.width, op.rows) for op in ops], dtype=np.int64).reshape(-1, 6)
        flat = (a[:, 5] == 1) | ((a[:, 1] == a[:, 4]) & (a[:, 3] == a[:, 4]))
        width = np.where(flat, a[:, 4] * a[:, 5], a[:, 4])
        rows = np.where(flat, 1, a[:, 5])
        seg = np.repeat(np.arange(len(a)), rows)
        r = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
        return a[seg, 0] + r * a[seg, 1], a[seg, 2] + r * a[seg, 3], width[seg], seg

    def plan_kernel(self, items: Sequence[CopyOp | Mark], launch_bytes: int | None = None) -> KernelPlan:
        """The row table and launches that move ``items`` (any device: on CPU the addresses are
        host addresses, which :func:`hpc_kernels.seg_copy.copy_rows_ref` can replay). Stages are
        joined into one launch until it holds ``launch_bytes``; a launch's events follow it."""
        seg_copy = _seg_copy()
        limit = self.kernel_launch_bytes if launch_bytes is None else launch_bytes
        ops: list[CopyOp] = []
        op_group: list[int] = []  # launch of each op
        launch_stages: list[list[int]] = [[]]
        nbytes, open_ops = 0, False
        for it in items:
            if isinstance(it, CopyOp):
                ops.append(it)
                op_group.append(len(launch_stages) - 1)
                nbytes += it.nbytes
                open_ops = True
            else:
                launch_stages[-1].append(it.stage)
                if nbytes >= limit:  # this launch is full: later stages go to the next
                    launch_stages.append([])
                    nbytes, open_ops = 0, False
        if len(launch_stages) > 1 and not launch_stages[-1] and not open_ops:
            launch_stages.pop()
        n = len(launch_stages)
        if ops:
            src, dst, nb, seg = self._segments(ops)
            table, bounds = seg_copy.plan_groups(src, dst, nb, np.asarray(op_group, dtype=np.int64)[seg], n)
        else:
            table, bounds = np.empty((0, seg_copy.COLUMNS), dtype=np.int64), [(0, 0, 0)] * n
        return KernelPlan(table, tuple(KernelLaunch(r0, r1, w, tuple(st))
                                       for (r0, r1, w), st in zip(bounds, launch_stages)))

    # -- the fast planner: blocks-only kernel jobs from a per-engine template ------------------
    #: whether restore()/write_through() may plan blocks-only kernel jobs from the template
    #: (the fake engine records CopyOps, so it keeps the general path)
    fast_plan = True

    def _chunk_addrs(self) -> np.ndarray:
        return np.array([self._kernel_addr.get(c.data_ptr(), c.data_ptr()) for c in self.host.chunks],
                        dtype=np.int64)

    def _template_entries(self, kind: str) -> list[tuple[int, list[tuple[bool, int]]]]:
        """``(stage, [(backend, layer)])`` in the order :meth:`plan_restore` / :meth:`plan_write`
        emit a blocks-only job's copies (stages without copies left out)."""
        if kind == "write":
            return [(0, [(False, a) for a in range(self.main.num_layers)]
                     + [(True, a) for a in range(self.backend.num_layers if self.backend else 0)])]
        prelude = [(True, a) for a in range(self.backend.num_layers if self.backend else 0)]
        prelude += [(False, a) for a in self.prelude_main_layers]
        out = [(0, prelude)] if prelude else []
        out += [(i + 1, [(False, idx)]) for i, (k, idx) in enumerate(self.layer_order) if k == "attn"]
        return out

    def _block_template(self, kind: str) -> _BlockTemplate | None:
        """The template of ``kind`` (``"restore"`` or ``"write"``), or None when blocks do not
        map onto it exactly: a row's alignment must not depend on the block (every page size
        and chunk address a multiple of 16 apart) and no copy may be packed on both sides (a
        plane page as large as the slab, which the general path moves as one segment)."""
        if kind in self._templates:
            return self._templates[kind]
        self._templates[kind] = t = self._build_template(kind)
        return t

    def _build_template(self, kind: str) -> _BlockTemplate | None:
        seg_copy = _seg_copy()
        align, chunk = seg_copy.ALIGN, seg_copy.CHUNK_BYTES
        sb = self.host.slab_bytes
        chunks = self._chunk_addrs()
        if not len(chunks) or (chunks % align != chunks[0] % align).any() or sb % align:
            return None
        slab0 = int(chunks[0])
        to_host = kind == "write"
        wide_rows: list[list[tuple]] = []
        narrow_rows: list[list[tuple]] = []
        stages, stage_bytes, ops, block_bytes = [], [], 0, 0
        for stage, entries in self._template_entries(kind):
            w: list[tuple] = []
            nr: list[tuple] = []
            nbytes = 0
            for backend, layer in entries:
                pool = self.backend if backend else self.main
                bases = (self._back_bases if backend else self._main_bases)[layer]
                for j, dev in enumerate(bases):
                    ppb = pool.plane_page_bytes[j]
                    if ppb % align or ppb >= sb:
                        return None
                    host = slab0 + (self.layout.backend_plane_offset(layer, j) if backend
                                    else self.layout.main_offset(layer, j))
                    daddr = self._base_addr.get(id(dev), dev.data_ptr())
                    aligned = host % align == 0 and daddr % align == 0
                    body = ppb - ppb % align if aligned else 0
                    mult = (0, ppb) if backend else (ppb, 0)
                    for o0, n, out in ((0, body, w), (body, ppb - body, nr)):
                        for o in range(o0, o0 + n, chunk):
                            out.append((host + o, daddr + o, *mult, min(chunk, o0 + n - o)))
                    ops += 1
                    nbytes += ppb
            stages.append(stage)
            stage_bytes.append(nbytes)
            block_bytes += nbytes
            wide_rows.append(w)
            narrow_rows.append(nr)
        rows = [r for w in wide_rows for r in w] + [r for nr in narrow_rows for r in nr]
        cols = np.array(rows, dtype=np.int64).reshape(-1, 5).T.copy()
        base = np.zeros((cols.shape[1], 1, 4), dtype=np.int64)
        base[:, 0, 1 if to_host else 0] = cols[0]
        base[:, 0, 0 if to_host else 1] = cols[1]
        base[:, 0, 2] = cols[4]
        return _BlockTemplate(to_host, tuple(stages), tuple(stage_bytes),
                              tuple(np.cumsum([0] + [len(w) for w in wide_rows]).tolist()),
                              tuple(np.cumsum([0] + [len(nr) for nr in narrow_rows]).tolist()),
                              cols[0], cols[1], cols[2], cols[3], cols[4], base, (cols[2] + cols[3])[:, None],
                              sum(len(w) for w in wide_rows), bool(cols[3].any()), ops, block_bytes)

    def plan_kernel_blocks(self, kind: str, blocks: Sequence[BlockRef],
                           launch_bytes: int | None = None) -> KernelPlan | None:
        """The :class:`KernelPlan` of a blocks-only job (``kind`` ``"restore"``: the blocks of a
        :class:`RestoreBatch` without tail or image; ``"write"``: write-through blocks and tails,
        no images) built from the block template: the same launches, stages and rows per launch
        as ``plan_kernel(plan_restore(...))`` / ``plan_kernel(plan_write(...))`` (rows may be
        ordered differently within a launch's wide and narrow parts). None when the template does
        not apply (see :meth:`_block_template`), for no blocks, or for a page or slab out of
        range (the general path then reports it)."""
        t = self._block_template(kind)
        if t is None or not len(blocks):
            return None
        try:
            b = np.array(blocks, dtype=np.int64)
        except ValueError:  # (page, slab) and (page, slab, backend page) refs mixed
            b = np.array([(r[0], r[1], r[2] if len(r) > 2 else r[0]) for r in blocks], dtype=np.int64)
        if b.ndim != 2 or b.shape[1] not in (2, 3):
            return None
        # pages and slabs in range (a negative one wraps to a huge unsigned value)
        lim = self._ref_limits[:b.shape[1]]
        if (b.view(np.uint64) >= lim).any():
            return None
        pm, sl = b[:, 0], b[:, 1]
        spc, sb = self.host.slabs_per_chunk, self.host.slab_bytes
        nblk = len(b)
        if len(self.host.chunks) == 1:
            delta = sl * sb
        else:
            chunks = self._chunk_addrs()
            delta = chunks[sl // spc] + (sl % spc) * sb - chunks[0]
        # rows x blocks x (src, dst, nbytes, 0): template row major, so a stage's rows stay together
        hcol, dcol = (1, 0) if t.to_host else (0, 1)
        full = np.repeat(t.base, nblk, axis=1) if nblk > 1 else t.base.copy()
        full[:, :, hcol] += delta
        if t.has_backend and b.shape[1] == 3:
            full[:, :, dcol] += t.main_ppb[:, None] * pm + t.back_ppb[:, None] * b[:, 2]
        else:
            full[:, :, dcol] += t.dev_ppb * pm
        # launches: stages are joined until one holds the limit (as plan_kernel joins them)
        limit = self.kernel_launch_bytes if launch_bytes is None else launch_bytes
        groups: list[tuple[int, int]] = []
        k0, acc = 0, 0
        for k, sbytes in enumerate(t.stage_bytes):
            acc += sbytes * nblk
            if acc >= limit:
                groups.append((k0, k + 1))
                k0, acc = k + 1, 0
        if k0 < len(t.stages) or not groups:
            groups.append((k0, len(t.stages)))
        nw = t.n_wide
        if nw == len(t.nbytes):  # every row wide (the common case): each launch is a row range
            table = full.reshape(-1, 4)
            launches = tuple(KernelLaunch(t.wide[k0] * nblk, t.wide[k1] * nblk, (t.wide[k1] - t.wide[k0]) * nblk,
                                          t.stages[k0:k1]) for k0, k1 in groups)
        elif len(groups) == 1:
            table = full.reshape(-1, 4)
            launches = (KernelLaunch(0, len(table), nw * nblk, t.stages),)
        else:
            parts, launches_l, row = [], [], 0
            for k0, k1 in groups:
                wide = full[t.wide[k0]:t.wide[k1]]
                narrow = full[nw + t.narrow[k0]:nw + t.narrow[k1]]
                parts += [wide, narrow]
                n = (len(wide) + len(narrow)) * nblk
                launches_l.append(KernelLaunch(row, row + n, len(wide) * nblk, t.stages[k0:k1]))
                row += n
            table = np.concatenate(parts).reshape(-1, 4)
            launches = tuple(launches_l)
        return KernelPlan(table, launches)

    def _fast_job(self, kind: str, blocks: Sequence[BlockRef]) -> _Job | None:
        """A kernel job planned from the block template, or None (then the general path plans
        it): CUDA with the kernel usable, and the job certain to take the kernel (``"kernel"``,
        or ``"auto"`` with its bytes per DMA call below the limit even at the fewest calls)."""
        if not (self.fast_plan and self.kernel_ok):
            return None
        t = self._block_template(kind)
        if t is None:
            return None
        nbytes = len(blocks) * t.block_bytes
        if self.copy_method != "kernel":
            # without cuda-python every block's plane page is one call (strided rows); with it
            # a job takes at least one call per (layer, plane)
            calls = t.ops * (len(blocks) if self.cudart is None else 1)
            if not nbytes < calls * self.kernel_max_call_bytes:
                return None
        plan = self.plan_kernel_blocks(kind, blocks)
        if plan is None:
            return None
        return _Job(next(self._ids), kind, [], 1 + len(self.layer_order), nbytes, method="kernel", plan=plan)

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A (pinned, device) pair of ``int64 [cap, 4]`` tables with ``cap >= rows``."""
        fits = [i for i, (h, _) in enumerate(self._table_pool) if h.shape[0] >= rows]
        if fits:
            return self._table_pool.pop(min(fits, key=lambda i: self._table_pool[i][0].shape[0]))
        cap = 1 << max(8, (rows - 1).bit_length())
        cols = _seg_copy().COLUMNS
        return (torch.empty(cap, cols, dtype=torch.int64, pin_memory=True),
                torch.empty(cap, cols, dtype=torch.int64, device=self.device))

    def _submit_kernel(self, job: _Job, stream: Any) -> None:
        seg_copy = _seg_copy()
        plan = job.plan if job.plan is not None else self.plan_kernel(job.items)
        n = len(plan.table)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if n:
                host_t, dev_t = job.tables = self._tables(n)
                host_t.numpy()[:n] = plan.table
                if self.table_on_host:  # the kernel reads the pinned table itself: no upload copy
                    dev_t = host_t
                else:
                    dev_t[:n].copy_(host_t[:n], non_blocking=True)
            for ln in plan.launches:
                if ln.row1 > ln.row0:
                    seg_copy.launch(dev_t[ln.row0:ln.row1], ln.n_wide)
                if ln.stages:  # one event after the launch serves every stage it holds
                    ev = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
                    ev.record(stream)
                    for s in ln.stages:
                        job.events[s] = ev

    # -- execution (CPU: at once; CUDA: streams; the fake overrides these) ---------------------
    def _new_job(self, kind: str, items: list[CopyOp | Mark]) -> _Job:
        nbytes = sum(op.nbytes for op in items if isinstance(op, CopyOp))
        return _Job(next(self._ids), kind, items, 1 + len(self.layer_order), nbytes)

    def _submit(self, job: _Job) -> None:
        if self.device.type != "cuda":
            try:
                for op in job.items:
                    if isinstance(op, CopyOp):
                        op.run_cpu()
            except Exception as exc:  # a bad view is a bug; report it as a failed job
                job.error = f"{type(exc).__name__}: {exc}"
            job.final = True
            self._queues[job.kind].append(job)
            return
        stream = self._streams[job.kind]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            job.method = "kernel" if job.plan is not None else self.choose_method(job.items)
            if job.method == "kernel":
                self._submit_kernel(job, stream)
            else:
                for op in job.items:
                    if isinstance(op, CopyOp):
                        self._copy(op, stream)
                    else:
                        ev = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
                        ev.record(stream)
                        job.events[op.stage] = ev
        except Exception as exc:
            job.error = f"{type(exc).__name__}: {exc}"
        ev = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
        ev.record(stream)
        job.final = ev
        self._queues[job.kind].append(job)

    def _copy(self, op: CopyOp, stream: Any) -> None:
        rows, width = op.rows, op.width
        flat = rows == 1 or (op.dst_pitch == width and op.src_pitch == width)
        rt = self.cudart
        if rt is not None:
            dptr = op.dst.data_ptr() + op.dst_off
            sptr = op.src.data_ptr() + op.src_off
            kind = rt.cudaMemcpyKind.cudaMemcpyDefault
            if flat:
                (err,) = rt.cudaMemcpyAsync(dptr, sptr, rows * width, kind, stream.cuda_stream)
            else:
                (err,) = rt.cudaMemcpy2DAsync(dptr, op.dst_pitch, sptr, op.src_pitch, width, rows, kind,
                                              stream.cuda_stream)
            if int(err) != 0:
                raise EngineError(f"transfer copy {op.tag} ({rows} x {width} B, pitches "
                                  f"{op.dst_pitch}/{op.src_pitch}) failed: CUDA error {err}")
            return
        dst, src = op.views()
        with torch.cuda.stream(stream):
            if flat:
                dst.copy_(src, non_blocking=True)
            else:
                for r in range(rows):
                    dst[r].copy_(src[r], non_blocking=True)

    def _finished(self, job: _Job) -> bool:
        if job.final is True or job.final is None:
            return True
        return bool(job.final.query())

    def _retire(self, job: _Job) -> None:
        job.done = True
        if self.device.type == "cuda":
            # kernel jobs share one event among a launch's stages: return each event once
            self._event_pool.extend({id(ev): ev for ev in job.events.values()}.values())
            if job.final is not None and job.final is not True:
                self._event_pool.append(job.final)
        job.events = {}
        job.final = True
        job.items = []  # drop the views
        job.plan = None
        if job.tables is not None:  # the copies landed: the tables can serve a later job
            if len(self._table_pool) < 8:
                self._table_pool.append(job.tables)
            job.tables = None
        self._retired.append(Completion(job.job_id, job.kind, job.error))

    def _wait(self, job: _Job, stage: int | None) -> None:
        if job.done or self.device.type != "cuda":
            return
        ev = job.final if stage is None else job.event_at_or_before(stage)
        if ev is not None and ev is not True:
            torch.cuda.current_stream(self.device).wait_event(ev)


class FakeTransferEngine(TransferEngine):
    """A test double: jobs are recorded, copied only when :meth:`complete` is called, and can be
    failed with :meth:`fail`. ``log`` lists ``("copy", job, stage, tag)``, ``("event", job,
    stage)`` and ``("wait", job, stage)`` in enqueue order. Works on any device (copies run
    synchronously at completion)."""

    fast_plan = False  # the log records CopyOps: always the general plan

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []
        self._complete_ids: set[int] = set()

    def _submit(self, job: _Job) -> None:
        for op in job.items:
            if isinstance(op, CopyOp):
                self.log.append(("copy", job.job_id, op.stage, op.tag))
            else:
                self.log.append(("event", job.job_id, op.stage))
                job.events[op.stage] = op
        self._queues[job.kind].append(job)

    def _finished(self, job: _Job) -> bool:
        return job.job_id in self._complete_ids

    def _jobs_upto(self, job_id: int) -> list[_Job]:
        for q in self._queues.values():
            ids = [j.job_id for j in q]
            if job_id in ids:
                return list(q)[:ids.index(job_id) + 1]
        raise KeyError(f"no pending job {job_id}")

    def complete(self, job_id: int | None = None) -> None:
        """Land job ``job_id`` (and the jobs before it on its stream), or every pending job."""
        jobs = [j for q in self._queues.values() for j in q] if job_id is None else self._jobs_upto(job_id)
        for j in jobs:
            if j.job_id in self._complete_ids:
                continue
            if j.error is None:
                for op in j.items:
                    if isinstance(op, CopyOp):
                        op.run_cpu()
            self._complete_ids.add(j.job_id)

    def fail(self, job_id: int, error: str = "injected transfer fault") -> None:
        """Make job ``job_id`` fail: it copies nothing and poll() reports the error."""
        for j in self._jobs_upto(job_id):
            if j.job_id == job_id:
                j.error = error
        self.complete(job_id)

    def drain(self) -> list[Completion]:
        self.complete()
        return self.poll()

    def _wait(self, job: _Job, stage: int | None) -> None:
        self.log.append(("wait", job.job_id, stage))
