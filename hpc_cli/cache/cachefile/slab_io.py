"""The prefix cache file's slab bytes (spec §5.5; layout in :mod:`~hpc_cli.cache.cachefile.format`).

Slabs go straight between the host storage and the file, many per ``writev`` / ``preadv``, with
no copy through a Python buffer, while a helper thread checksums each run (:class:`_Hasher`).
:func:`save_cache_file` writes a whole file (a temporary file renamed into place; an abandon flag
stops it), :func:`read_plan_slabs` reads the slabs a :class:`~hpc_cli.cache.cachefile.plan.RestorePlan`
adopts and :func:`verify_slabs` checks every run. Pure Python.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import xxhash

from hpc_cli.cache.cachefile.format import CacheFile, Geometry, SavePlan, damaged, layout_file
from hpc_cli.cache.cachefile.plan import RestorePlan


class SaveAbandoned(Exception):
    """The save stopped on the abandon flag; the temporary file is gone, the previous file stays."""



#: bytes one writev / preadv moves: slabs go straight between the host storage and the file, many
#: per system call, with no copy through a Python buffer. Reads are larger (a 200 MB load read in
#: 32 MiB calls ran ~10% behind one plain read; in 128 MiB calls, level with it); a write batch is
#: also how often the abandon flag is checked.
WRITE_BATCH_BYTES = 64 << 20
READ_BATCH_BYTES = 128 << 20
try:
    IO_BATCH_BUFFERS = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):  # pragma: no cover
    IO_BATCH_BUFFERS = 1024


def _bytes_view(buf: Any, nbytes: int, what: str) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    assert len(mv) == nbytes, f"{what}: {len(mv)} bytes, expected {nbytes}"
    return mv


def _batches(views: list[memoryview], max_bytes: int) -> Iterable[list[memoryview]]:
    """Consecutive groups of at most ``max_bytes`` (at least one buffer) and IO_BATCH_BUFFERS."""
    group: list[memoryview] = []
    n = 0
    for v in views:
        if group and (n + len(v) > max_bytes or len(group) >= IO_BATCH_BUFFERS):
            yield group
            group, n = [], 0
        group.append(v)
        n += len(v)
    if group:
        yield group


def _write_all(fd: int, views: list[memoryview]) -> None:
    """``os.writev`` until every byte of ``views`` is written (a short write resumes)."""
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def _pread_all(fd: int, views: list[memoryview], offset: int) -> int:
    """``os.preadv`` into ``views`` from ``offset``; returns the bytes read (less only at EOF)."""
    got = 0
    while views:
        n = os.preadv(fd, views, offset + got) if _HAVE_PREADV else _pread_fallback(fd, views, offset + got)
        if n <= 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    return got


_HAVE_PREADV = hasattr(os, "preadv")


def _pread_fallback(fd: int, views: list[memoryview], offset: int) -> int:  # pragma: no cover - no preadv
    got = 0
    for v in views:
        b = os.pread(fd, len(v), offset + got)
        v[:len(b)] = b
        got += len(b)
        if len(b) < len(v):
            break
    return got


class _Hasher:
    """xxh3_64 of slab runs on one helper thread, in submission order, overlapping the file I/O
    (xxhash and the system calls release the GIL). ``feed(run, views)`` queues; ``digests()``
    waits and returns each run's digest."""

    def __init__(self, nruns: int) -> None:
        import queue

        self._hs = [xxhash.xxh3_64() for _ in range(nruns)]
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._work, name="hpc-cache-file-hash", daemon=True)
        self._t.start()

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                for run, v in item:
                    self._hs[run].update(v)
            except BaseException as exc:  # pragma: no cover - surfaced by digests()
                self._error = exc

    def feed(self, items: list[tuple[int, memoryview]]) -> None:
        self._q.put(items)

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(None)
            self._t.join()

    def digests(self) -> list[int]:
        self.close()
        if self._error is not None:
            raise self._error
        return [h.intdigest() for h in self._hs]


# ------------------------------------------------------------------ writing
def write_cache_file(f: BinaryIO, fingerprint: dict, geom: Geometry, plan: SavePlan,
                     read_slab: Callable[[int], Any], *, abandon: threading.Event | None = None,
                     on_bytes: Callable[[int], None] | None = None) -> int:
    """Write the file to ``f`` (opened ``wb``, seekable); returns its size. ``read_slab(host_slab)``
    gives one slab's bytes (a buffer of ``slab_bytes``). ``abandon`` is checked before every slab
    run: once set, :class:`SaveAbandoned` is raised."""
    lay = layout_file(fingerprint, geom, plan)
    f.write(lay.head())
    sb = geom.slab_bytes
    order = lay.order
    # file slab i's bytes, tagged with its run; written many slabs per writev straight from the
    # host storage while a helper thread checksums them
    tagged: list[tuple[int, memoryview]] = []
    for k, (first, count) in enumerate(lay.runs):
        for i in range(first, first + count):
            tagged.append((k, _bytes_view(read_slab(order[i]), sb, f"slab {order[i]}")))
    try:
        fd = f.fileno()
        f.flush()
    except (AttributeError, OSError, ValueError):  # not a real file (BytesIO): plain writes
        fd = None
    hasher = _Hasher(len(lay.runs))
    try:
        at = 0
        for group in _batches([v for _, v in tagged], WRITE_BATCH_BYTES):
            if abandon is not None and abandon.is_set():
                raise SaveAbandoned()
            items = tagged[at:at + len(group)]
            at += len(group)
            hasher.feed(items)
            if fd is not None:
                _write_all(fd, group)
            else:
                for v in group:
                    f.write(v)
            if on_bytes is not None:
                on_bytes(len(group) * sb)
        sums_k = hasher.digests()
    finally:
        hasher.close()
    runs_at, rt, head = lay.seal(sums_k)
    f.seek(runs_at)
    f.write(rt)
    f.seek(0)
    f.write(head)
    f.seek(0, os.SEEK_END)
    return lay.size


def save_cache_file(path: str | Path, fingerprint: dict, geom: Geometry, plan: SavePlan,
                    read_slab: Callable[[int], Any], *, abandon: threading.Event | None = None,
                    on_bytes: Callable[[int], None] | None = None, fsync: bool = True) -> int:
    """Write a temporary file in ``path``'s directory, then rename it into place. On abandon (or
    any error) the temporary file is deleted and the previous file stays."""
    path = Path(path)
    if abandon is not None and abandon.is_set():
        raise SaveAbandoned()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb", buffering=8 << 20) as f:
            size = write_cache_file(f, fingerprint, geom, plan, read_slab, abandon=abandon, on_bytes=on_bytes)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if abandon is not None and abandon.is_set():
            raise SaveAbandoned()
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    if fsync:
        try:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:  # pragma: no cover - platforms without directory fsync
            pass
    return size


# ------------------------------------------------------------------ reading
def read_plan_slabs(cf: CacheFile, plan: RestorePlan, dest: Callable[[int], Any], host_slabs: list[int], *,
                    on_bytes: Callable[[int], None] | None = None) -> dict[int, int]:
    """Read the plan's slabs into ``host_slabs`` (``dest(host_slab)`` is a writable buffer of one
    slab), checking each run's checksum. Returns file slab -> host slab. Raises CacheFileError."""
    sb = cf.geometry.slab_bytes
    wanted: list[int] = list(plan.blocks)  # node i is file slab i
    for j in plan.snapshots:
        s = cf.snapshots[j]
        wanted += range(s.first_slab, s.first_slab + cf.snapshot_slabs(s))
    assert len(wanted) == len(host_slabs) == plan.slabs, (len(wanted), len(host_slabs), plan.slabs)
    mapping = dict(zip(wanted, host_slabs))
    # the runs to read, grouped into stretches of consecutive runs (one place in the file each)
    stretches: list[list[int]] = []
    for k, (first, count, _) in enumerate(cf.runs):
        if first not in mapping:
            continue
        if stretches and stretches[-1][-1] == k - 1:
            stretches[-1].append(k)
        else:
            stretches.append([k])
    hasher = _Hasher(len(cf.runs))
    try:
        with open(cf.path, "rb", buffering=0) as f:
            fd = f.fileno()
            for ks in stretches:
                tagged = []
                for k in ks:
                    first, count, _ = cf.runs[k]
                    for i in range(first, first + count):
                        tagged.append((k, _bytes_view(dest(mapping[i]), sb, f"host slab {mapping[i]}")))
                off = cf.slabs_offset + cf.runs[ks[0]][0] * sb
                at = 0
                for group in _batches([v for _, v in tagged], READ_BATCH_BYTES):
                    want_n = len(group) * sb
                    if _pread_all(fd, list(group), off) != want_n:
                        raise damaged(cf.path, f"slab run {tagged[at][0]} truncated")
                    hasher.feed(tagged[at:at + len(group)])
                    at += len(group)
                    off += want_n
                    if on_bytes is not None:
                        on_bytes(want_n)
        got = hasher.digests()
    finally:
        hasher.close()
    for ks in stretches:
        for k in ks:
            first, count, want = cf.runs[k]
            if got[k] != want:
                raise damaged(cf.path, f"slab run {k} (file slabs {first}..{first + count - 1}) checksum mismatch")
    return mapping


def verify_slabs(cf: CacheFile, *, on_bytes: Callable[[int], None] | None = None,
                 chunk_bytes: int = 32 << 20) -> list[str]:
    """Check every slab run's checksum; returns the problems (empty when the file is sound)."""
    sb = cf.geometry.slab_bytes
    problems = []
    buf = bytearray(max(sb, (chunk_bytes // sb) * sb))
    with open(cf.path, "rb", buffering=0) as f:
        f.seek(cf.slabs_offset)
        for k, (first, count, want) in enumerate(cf.runs):
            h = xxhash.xxh3_64()
            left = count * sb
            while left:
                n = min(left, len(buf))
                mv = memoryview(buf)[:n]
                got = f.readinto(mv)
                if got != n:
                    problems.append(f"slab run {k} truncated")
                    return problems
                h.update(mv)
                left -= n
                if on_bytes is not None:
                    on_bytes(n)
            if h.intdigest() != want:
                problems.append(f"slab run {k} (file slabs {first}..{first + count - 1}) checksum mismatch")
    return problems
