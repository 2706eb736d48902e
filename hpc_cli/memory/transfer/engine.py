"""The transfer engine: restores (host -> device) and write-through (device -> host) on their
own CUDA streams (spec §6.4-6.5, §7.4, §7.6-7.7, §11.1-11.2; ARCHITECTURE.md §5).

A restore batch is enqueued on the restore stream in the order a forward pass reads it, as the
stages of :mod:`~hpc_cli.memory.transfer.plan`, with an event after each stage that copied
something. :meth:`RestoreTicket.wait_layer` makes the compute stream wait for the latest event at
or before that layer's stage. The restore stream first waits for the compute stream's queued work
(destinations may have been read by earlier kernels); write-through runs on its own stream after
the compute stream's queued work (the data must be written first). Each stream completes its jobs
in order; :meth:`TransferEngine.poll` retires finished jobs and never blocks.

DMA copies go through ``cudaMemcpy2DAsync`` of cuda-python (``cuda.bindings.runtime`` or the
older ``cuda.cudart``) when it is installed, otherwise one torch copy when both sides are
contiguous and one per row when not (torch's copy of a strided host view stages it through a
pageable buffer). Kernel jobs (:mod:`~hpc_cli.memory.transfer.kernel_plan`) write their row
table to a pinned buffer that the kernel reads (or that is copied to the device on the job's
stream first; no device sync); both buffers stay with the job until it retires, then serve later
jobs.

On CPU the copies run at once and every job is complete when submitted;
:class:`~hpc_cli.memory.transfer.fake.FakeTransferEngine` records the operations and copies only
when told.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from typing import Any, Sequence

import torch

from hpc_cli.errors import EngineError
from hpc_cli.memory.cudart import load_cudart
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.kernel_plan import (COPY_ENV, KERNEL_LAUNCH_BYTES, KERNEL_MAX_CALL_BYTES,
                                                 KernelPlanner, seg_copy_module)
from hpc_cli.memory.transfer.records import (BlockRef, Completion, CopyOp, ImageRef, Job, Mark, RestoreBatch,
                                             RestoreTicket, TransferJob)


def write_programs_from_env(value: str | None) -> int | None:
    """``HPC_SEG_WRITE_PROGRAMS``: a positive count of programs, or None for unset, empty or 0."""
    if not value or value.strip() == "0":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 1:
        raise EngineError(f"HPC_SEG_WRITE_PROGRAMS={value!r} is not a count of programs",
                          hint="set it to a positive integer (for example 16), or unset it for a program a row")
    return n


class TransferEngine(KernelPlanner):
    """Restores and write-through between device pools/state slots and host slabs.

    ``main``: the main KV pool's storage; ``backend``: a backend's own pool (DFlash) or None;
    ``state``: the state slots (images) or None; ``layer_order``: model layers in forward order
    (:func:`~hpc_cli.memory.transfer.plan.layer_order_for_shape`), default all attention layers
    then all GDN layers; main KV layers not named there (MTP's extra layer) are copied in the
    prelude. ``copy_method``, ``kernel_max_call_bytes`` and ``kernel_launch_bytes``: see
    :mod:`~hpc_cli.memory.transfer.kernel_plan` (CUDA only; CPU copies are plain copies whatever
    the method).
    """

    def __init__(self, main: PagedKVStorage, host: HostSlabStorage, *, state: StateSlots | None = None,
                 backend: PagedKVStorage | None = None,
                 layer_order: Sequence[tuple[str, int]] | None = None,
                 use_cuda_python: bool = True, copy_method: str | None = None,
                 kernel_max_call_bytes: int = KERNEL_MAX_CALL_BYTES,
                 kernel_launch_bytes: int = KERNEL_LAUNCH_BYTES) -> None:
        super().__init__(main, host, state=state, backend=backend, layer_order=layer_order,
                         copy_method=copy_method, kernel_max_call_bytes=kernel_max_call_bytes,
                         kernel_launch_bytes=kernel_launch_bytes)
        self._ids = itertools.count(1)
        self._queues: dict[str, deque[Job]] = {"restore": deque(), "write": deque()}
        self._retired: list[Completion] = []
        self._streams: dict[str, Any] = {}
        self._event_pool: list[Any] = []
        self._table_pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the kernel reads its row table from pinned host memory (mapped) instead of uploading
        #: it first: a 1-block restore went from 0.82 to 0.92 of a contiguous copy on an H200
        #: (``HPC_SEG_TABLE_HOST=0`` uploads it, as before; docs/memory.md)
        self.table_on_host = os.environ.get("HPC_SEG_TABLE_HOST", "1") != "0"
        #: the programs a write-through's copy launch may run (``HPC_SEG_WRITE_PROGRAMS``; unset or
        #: 0: a program a row): a copy to the host tier is bound by the host link, and the SMs it
        #: does not hold stay with the decode steps running beside it (docs/memory.md)
        self.write_programs = write_programs_from_env(os.environ.get("HPC_SEG_WRITE_PROGRAMS"))
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
        return seg_copy_module().probe(self.device)

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

    def _restore_job(self, batch: RestoreBatch) -> Job:
        """The job of a restore batch: from the block template when it is a blocks-only kernel
        job (CUDA), else from :meth:`plan_restore`."""
        if batch.tail is None and batch.image is None and batch.blocks:
            job = self._fast_job("restore", batch.blocks)
            if job is not None:
                return job
        return self._new_job("restore", self.plan_restore(batch))

    def _write_job(self, blocks: Sequence[BlockRef], images: Sequence[ImageRef], tails: Sequence[BlockRef]) -> Job:
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

    def _fast_job(self, kind: str, blocks: Sequence[BlockRef]) -> Job | None:
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
        return Job(next(self._ids), kind, [], 1 + len(self.layer_order), nbytes, method="kernel", plan=plan)

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A (pinned, device) pair of ``int64 [cap, 4]`` tables with ``cap >= rows``."""
        fits = [i for i, (h, _) in enumerate(self._table_pool) if h.shape[0] >= rows]
        if fits:
            return self._table_pool.pop(min(fits, key=lambda i: self._table_pool[i][0].shape[0]))
        cap = 1 << max(8, (rows - 1).bit_length())
        cols = seg_copy_module().COLUMNS
        return (torch.empty(cap, cols, dtype=torch.int64, pin_memory=True),
                torch.empty(cap, cols, dtype=torch.int64, device=self.device))

    def _submit_kernel(self, job: Job, stream: Any) -> None:
        seg_copy = seg_copy_module()
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
            programs = self.write_programs if job.kind == "write" else None
            for ln in plan.launches:
                if ln.row1 > ln.row0:
                    seg_copy.launch(dev_t[ln.row0:ln.row1], ln.n_wide, programs=programs)
                if ln.stages:  # one event after the launch serves every stage it holds
                    ev = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
                    ev.record(stream)
                    for s in ln.stages:
                        job.events[s] = ev

    # -- execution (CPU: at once; CUDA: streams; the fake overrides these) ---------------------
    def _new_job(self, kind: str, items: list[CopyOp | Mark]) -> Job:
        nbytes = sum(op.nbytes for op in items if isinstance(op, CopyOp))
        return Job(next(self._ids), kind, items, 1 + len(self.layer_order), nbytes)

    def _submit(self, job: Job) -> None:
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

    def _finished(self, job: Job) -> bool:
        if job.final is True or job.final is None:
            return True
        return bool(job.final.query())

    def _retire(self, job: Job) -> None:
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

    def _wait(self, job: Job, stage: int | None) -> None:
        if job.done or self.device.type != "cuda":
            return
        ev = job.final if stage is None else job.event_at_or_before(stage)
        if ev is not None and ev is not True:
            torch.cuda.current_stream(self.device).wait_event(ev)
