"""Batched byte copies: many ``(src, dst, nbytes)`` segments in one Triton launch.

A separate ``cudaMemcpyAsync`` costs ~10 us in the driver, so a job of many small segments (one
block bundle is 64 plane pages of 2-64 KiB) is bound by the calls, not by the bus. Here the
segments become a *row table* and one launch copies them all: each program copies one row.

Row table: ``int64 [rows, 4]``, columns ``src, dst, nbytes, slot_stride``. A program copies
``nbytes`` bytes from ``src + src_slot * slot_stride`` to ``dst + dst_slot * slot_stride``
(``src_slot``/``dst_slot`` are launch arguments; plain jobs use stride 0, the state tap keeps one
table per pool and passes the two slots). :func:`plan_rows` splits segments into rows of at most
``chunk`` bytes. The first ``n_wide`` rows are *wide*: both addresses and the slot stride are
multiples of 16 and so is ``nbytes``; they move as 16-byte vector words (one masked load of the
whole row, then one store, so a thread has all its loads in flight at once). The other rows (an
aligned segment's last ``nbytes % 16`` bytes, or a segment whose addresses are not 16-byte
aligned) move a byte at a time.

Addresses are raw: device memory, or host memory pinned through CUDA (mapped: under unified
addressing a kernel reads and writes it at its device address, ``HostSlabStorage.device_ptrs``).
Raw addresses become pointers with ``.to(tl.pointer_type(...))``, and ``tl.multiple_of`` on the
pointer lets Triton emit 16-byte loads and stores.

:func:`copy_rows_ref` is the reference twin: the same rows moved with ``memmove`` on host
addresses (CPU tensors), so planning is tested without a GPU. The kernel also runs under
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) on CPU tensors.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton, or one that cannot load here: the callers keep their DMA copies
    triton = None

CHUNK_BYTES = 16384  # bytes of one row (one program): 8 x 16 B in flight per thread at 4 warps
NARROW_BYTES = 1024  # bytes per step of the byte-wise path
NUM_WARPS = 4
ALIGN = 16
COLUMNS = 4  # src, dst, nbytes, slot_stride


def available() -> bool:
    """Whether the Triton kernel can be launched (Triton imports)."""
    return triton is not None


def probe(device: torch.device | str) -> str | None:
    """Why the kernel cannot copy on ``device`` (None when it can): Triton must import, and a
    first launch (a wide row and a narrow tail, device to device) must compile and copy
    exactly. Checked once per device (one synchronisation, at startup)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the kernel runs on CUDA devices, not {device.type}"
    if triton is None:
        return "Triton does not import"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return _probe(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _probe(index: int) -> str | None:
    try:
        with torch.cuda.device(index):
            a = torch.arange(64, dtype=torch.uint8, device="cuda")
            b = torch.zeros(64, dtype=torch.uint8, device="cuda")
            keep = copy_segments([a.data_ptr(), a.data_ptr() + 32], [b.data_ptr(), b.data_ptr() + 33],
                                 [21, 7], "cuda")
            torch.cuda.synchronize()
            want = torch.zeros(64, dtype=torch.uint8)
            want[:21] = torch.arange(21, dtype=torch.uint8)
            want[33:40] = torch.arange(32, 39, dtype=torch.uint8)
            del keep
            if not torch.equal(b.cpu(), want):
                return "the kernel's probe copy gave wrong bytes"
    except Exception as exc:  # a Triton that cannot compile this kernel here
        return f"the kernel does not build or launch: {type(exc).__name__}: {exc}"
    return None


def plan_rows(src, dst, nbytes, stride=None, chunk: int = CHUNK_BYTES) -> tuple[np.ndarray, int]:
    """Rows for segments ``(src[i], dst[i], nbytes[i])`` (with ``stride[i]``, default 0):
    ``(table int64 [rows, 4], n_wide)``, wide rows first, each row at most ``chunk`` bytes.
    Zero-length segments are dropped. Rows keep segment order within the wide and the narrow part
    (order does not matter to the copy: segments must not overlap)."""
    nb = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    table, bounds = plan_groups(src, dst, nb, np.zeros(nb.shape, dtype=np.int64), 1, stride, chunk)
    return table, bounds[0][2]


def plan_groups(src, dst, nbytes, group, n_groups: int, stride=None,
                chunk: int = CHUNK_BYTES) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """:func:`plan_rows` for segments in launch groups ``group[i]`` (``0..n_groups-1``): one
    table with each group's rows together, in group order, wide rows first; and per group
    ``(row0, row1, n_wide)``."""
    assert chunk > 0 and chunk % ALIGN == 0, f"row size {chunk} must be a positive multiple of {ALIGN}"
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    nb = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    grp = np.asarray(group, dtype=np.int64).reshape(-1)
    st = np.zeros_like(nb) if stride is None else np.broadcast_to(np.asarray(stride, dtype=np.int64), nb.shape)
    assert src.shape == dst.shape == nb.shape == grp.shape, \
        f"segment arrays differ: {src.shape} {dst.shape} {nb.shape} {grp.shape}"
    assert (nb >= 0).all(), "a segment has a negative length"
    assert not len(grp) or (grp.min() >= 0 and grp.max() < n_groups), f"a group id is outside 0..{n_groups - 1}"
    aligned = (src % ALIGN == 0) & (dst % ALIGN == 0) & (st % ALIGN == 0)
    body = np.where(aligned, nb - nb % ALIGN, 0)
    # pieces: aligned bodies (wide), then aligned tails and whole unaligned segments (narrow);
    # key = 2 * group + narrow orders the rows
    rest = nb - body
    narrow = rest > 0
    tail = np.where(aligned, body, 0)[narrow]
    rows, key = _chunks(np.concatenate([src, src[narrow] + tail]), np.concatenate([dst, dst[narrow] + tail]),
                        np.concatenate([body, rest[narrow]]), np.concatenate([st, st[narrow]]),
                        np.concatenate([2 * grp, 2 * grp[narrow] + 1]), chunk)
    if len(key) > 1 and (key[1:] < key[:-1]).any():
        order = np.argsort(key, kind="stable")
        rows = rows[order]
    counts = np.bincount(key, minlength=2 * n_groups).reshape(n_groups, 2)
    ends = np.cumsum(counts.sum(axis=1))
    starts = ends - counts.sum(axis=1)
    return np.ascontiguousarray(rows), list(zip(starts.tolist(), ends.tolist(), counts[:, 0].tolist()))


def _chunks(src: np.ndarray, dst: np.ndarray, nb: np.ndarray, st: np.ndarray, key: np.ndarray,
            chunk: int) -> tuple[np.ndarray, np.ndarray]:
    keep = nb > 0
    src, dst, nb, st, key = src[keep], dst[keep], nb[keep], st[keep], key[keep]
    counts = -(-nb // chunk)
    seg = np.repeat(np.arange(len(nb)), counts)
    off = (np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    out = np.empty((len(seg), COLUMNS), dtype=np.int64)
    out[:, 0] = src[seg] + off
    out[:, 1] = dst[seg] + off
    out[:, 2] = np.minimum(chunk, nb[seg] - off)
    out[:, 3] = st[seg]
    return out, key[seg]


def copy_rows_ref(table, n_wide: int, src_slot: int = 0, dst_slot: int = 0) -> None:
    """The kernel's twin on host addresses (CPU tensors): ``memmove`` each row."""
    rows = np.asarray(table, dtype=np.int64).reshape(-1, COLUMNS)
    for i, (s, d, n, st) in enumerate(rows.tolist()):
        if i < n_wide:
            assert s % ALIGN == 0 and d % ALIGN == 0 and n % ALIGN == 0 and st % ALIGN == 0, \
                f"wide row {i} is not 16-byte aligned: {s} {d} {n} {st}"
        ctypes.memmove(d + dst_slot * st, s + src_slot * st, n)


def launch(table: torch.Tensor, n_wide: int, src_slot: int = 0, dst_slot: int = 0,
           chunk: int = CHUNK_BYTES, programs: int | None = None) -> None:
    """Copy every row of ``table`` (``int64 [rows, 4]``, on the device or pinned; a view is fine)
    with one launch on the current stream. ``chunk`` must be the planning row size.
    ``programs``: at most this many programs, each copying every ``programs``-th row (a copy
    bound by the host link needs few SMs, and leaves the others to kernels running beside it);
    None: a program a row."""
    assert triton is not None, "the segment copy kernel needs Triton"
    assert table.dtype == torch.int64 and table.dim() == 2 and table.shape[1] == COLUMNS, \
        f"row table must be int64 [rows, {COLUMNS}], got {table.dtype} {tuple(table.shape)}"
    assert table.is_contiguous(), "row table must be contiguous"
    assert programs is None or programs > 0, f"programs must be positive, got {programs}"
    rows = table.shape[0]
    if rows == 0:
        return
    if programs is None or programs >= rows:
        _copy_rows[(rows,)](table, n_wide, src_slot, dst_slot, WORDS=chunk // 4, NARROW=NARROW_BYTES,
                           num_warps=NUM_WARPS)
    else:
        _copy_rows_strided[(programs,)](table, n_wide, src_slot, dst_slot, rows, WORDS=chunk // 4,
                                        NARROW=NARROW_BYTES, num_warps=NUM_WARPS, num_stages=1)


def copy_segments(src, dst, nbytes, device: torch.device | str, chunk: int = CHUNK_BYTES,
                  programs: int | None = None):
    """Plan, upload and launch in one call (tests and tools): returns the tables, which must
    stay alive until the copy completes. On CPU (under the interpreter) the table stays on the
    host. ``programs``: :func:`launch`'s."""
    device = torch.device(device)
    rows, n_wide = plan_rows(src, dst, nbytes, chunk=chunk)
    host = torch.from_numpy(rows)
    if device.type == "cuda":
        host = host.pin_memory()
        table = torch.empty_like(host, device=device)
        table.copy_(host, non_blocking=True)
    else:
        table = host
    launch(table, n_wide, chunk=chunk, programs=programs)
    return host, table


if triton is not None:
    @triton.jit
    def _copy_row(table, pid, n_wide, src_slot, dst_slot, WORDS: tl.constexpr, NARROW: tl.constexpr):
        # row pid (int64) of the table
        row = table + pid * 4
        stride = tl.load(row + 3)
        src = tl.load(row) + src_slot * stride
        dst = tl.load(row + 1) + dst_slot * stride
        n = tl.load(row + 2)
        if pid < n_wide:
            ws = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
            wd = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
            nw = (n >> 4) << 2  # words; a multiple of 4, so the mask holds per 16-byte vector
            wo = tl.arange(0, WORDS)
            wm = wo < nw
            tl.store(wd + wo, tl.load(ws + wo, mask=wm), mask=wm)
        else:
            bs = src.to(tl.pointer_type(tl.int8))
            bd = dst.to(tl.pointer_type(tl.int8))
            bo = tl.arange(0, NARROW)
            for i in range(0, WORDS * 4, NARROW):  # a row holds at most WORDS * 4 bytes
                bm = bo < n - i
                tl.store(bd + i + bo, tl.load(bs + i + bo, mask=bm), mask=bm)

    @triton.jit(do_not_specialize=["n_wide", "src_slot", "dst_slot"])
    def _copy_rows(table, n_wide, src_slot, dst_slot, WORDS: tl.constexpr, NARROW: tl.constexpr):
        _copy_row(table, tl.program_id(0).to(tl.int64), n_wide, src_slot, dst_slot, WORDS, NARROW)

    @triton.jit(do_not_specialize=["n_wide", "src_slot", "dst_slot", "rows"])
    def _copy_rows_strided(table, n_wide, src_slot, dst_slot, rows, WORDS: tl.constexpr, NARROW: tl.constexpr):
        # program p copies rows p, p + grid, ... (launched with num_stages=1: nothing to pipeline)
        for r in range(tl.program_id(0), rows, tl.num_programs(0)):
            # (under the interpreter the loop's index is a Python int)
            _copy_row(table, tl.cast(r, tl.int64), n_wide, src_slot, dst_slot, WORDS, NARROW)
