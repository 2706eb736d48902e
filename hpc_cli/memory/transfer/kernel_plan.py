"""The segment copy kernel's plans of the transfer engine's jobs (``hpc_kernels.seg_copy``: one
launch copies a table of ``(src, dst, bytes)`` rows, reading and writing pinned host slabs at
their mapped addresses).

Copy method, chosen per job (``copy_method``: ``"auto"``, ``"dma"``, ``"kernel"``; default the
environment variable ``HPC_TRANSFER_COPY``, else ``"auto"``): ``"dma"`` is the copies of
:mod:`~hpc_cli.memory.transfer.plan`, on the copy engines; ``"kernel"`` moves the job's copies
with the kernel. A separate copy costs ~10 us in the driver, so a job of many small copies (one
2 MiB block bundle is 64 of them) is bound by the calls; the kernel takes one launch. ``"auto"``
uses the kernel when the job's bytes per DMA call are below ``kernel_max_call_bytes`` (1 MiB)
and the DMA copies otherwise (big runs already reach ~0.95 of a contiguous copy on the copy
engines and leave the SMs to the model). The kernel path keeps the stages: consecutive stages
are joined into one launch until it holds ``kernel_launch_bytes`` (8 MiB), and one event is
recorded after each launch and shared by every stage it holds (a 1-block restore is one launch,
then one event for all its stages).

A blocks-only kernel job (restore blocks without tail or image; write-through blocks and tails
without images) is planned without CopyOps: its table is a per-engine *block template*
(:class:`BlockTemplate`: the rows of one bundle at page 0 / slab 0, with per-row page and slab
multipliers) broadcast over the job's blocks (:meth:`KernelPlanner.plan_kernel_blocks`), the same
launches and rows as :meth:`KernelPlanner.plan_kernel` of the general plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from hpc_cli.errors import EngineError
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.plan import TransferPlanner
from hpc_cli.memory.transfer.records import BlockRef, CopyOp, Mark

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


def seg_copy_module():
    """:mod:`hpc_kernels.seg_copy`, imported on first use (it imports Triton)."""
    from hpc_kernels import seg_copy

    return seg_copy


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
class BlockTemplate:
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

class KernelPlanner(TransferPlanner):
    """The DMA plan, plus the segment copy kernel's plans of the same jobs: the copy method a
    job takes (:meth:`choose_method`), the row table and launches of a general plan
    (:meth:`plan_kernel`) and of a blocks-only job from the block template
    (:meth:`plan_kernel_blocks`). ``copy_method``, ``kernel_max_call_bytes`` and
    ``kernel_launch_bytes``: see the module doc. ``kernel_ok`` (whether the kernel can run here)
    and ``cudart`` (2D copies: one DMA call per strided copy) are the engine's to set.
    """

    def __init__(self, main: PagedKVStorage, host: HostSlabStorage, *, state: StateSlots | None = None,
                 backend: PagedKVStorage | None = None,
                 layer_order: Sequence[tuple[str, int]] | None = None, copy_method: str | None = None,
                 kernel_max_call_bytes: int = KERNEL_MAX_CALL_BYTES,
                 kernel_launch_bytes: int = KERNEL_LAUNCH_BYTES) -> None:
        super().__init__(main, host, state=state, backend=backend, layer_order=layer_order)
        self.cudart: Any = None
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
        self._templates: dict[str, BlockTemplate | None] = {}  # per job kind, built on first use
        # bounds of a block ref's (page, slab, backend page), for the fast planner's range check
        self._ref_limits = np.array([main.num_pages, host.num_slabs,
                                     backend.num_pages if backend is not None else 1 << 63], dtype=np.uint64)
        self.kernel_ok = False
        self.kernel_unavailable: str | None = "CPU copies are plain copies"  # why kernel_ok is False

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
        seg_copy = seg_copy_module()
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

    def _block_template(self, kind: str) -> BlockTemplate | None:
        """The template of ``kind`` (``"restore"`` or ``"write"``), or None when blocks do not
        map onto it exactly: a row's alignment must not depend on the block (every page size
        and chunk address a multiple of 16 apart) and no copy may be packed on both sides (a
        plane page as large as the slab, which the general path moves as one segment)."""
        if kind in self._templates:
            return self._templates[kind]
        self._templates[kind] = t = self._build_template(kind)
        return t

    def _build_template(self, kind: str) -> BlockTemplate | None:
        seg_copy = seg_copy_module()
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
        return BlockTemplate(to_host, tuple(stages), tuple(stage_bytes),
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
