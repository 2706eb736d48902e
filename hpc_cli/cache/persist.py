"""The prefix cache file (spec §5.5; format in docs/prefix-cache-file.md). Pure Python.

Layout, every integer little-endian::

    header      magic "HPCPFX\\r\\n", u32 format, u32 meta length, meta (UTF-8 JSON: fingerprint,
                geometry, counts, section offsets/lengths/checksums), u64 xxh3_64 of all of it
    blocks      one 276 B record a node, parents first: i32 parent (-1: root), u64 extra,
                u64 lookup hash, 256 B tokens
    snapshots   i32 anchor (-1: root), u64 frontier, u8 kind, u32 hits, u16 tail length,
                u32 first file slab, u64 tail media key, then the tail tokens (4 B each)
    media       one 64 B record per Vision item a block holds: u32 block, 32 B content digest,
                u32 modality, u32 grid t, h, w, u64 span begin, u32 span length
    runs        u32 first slab, u32 slab count, u64 xxh3_64 of the run's bytes
    slabs       at a 4 KiB boundary: file slab i at slabs_offset + i * slab_bytes

Node ``i`` lives in file slab ``i``; a snapshot's image takes ``image_slabs`` file slabs from its
first slab on, and its tail slab follows. A node is one run; a snapshot's slabs are one run
(split at :data:`RUN_MAX_BYTES`). The header, each table and each run carry an xxh3_64 checksum, and
the file's size must equal what its tables say, so damage is found before anything is trusted.

The saveable subset (:func:`export_saveable`): retained (not superseded) snapshots whose image (and
tail) is host Resident and whose anchor path is host Resident, and exactly those paths. A
smaller host tier restores whole snapshots greedily by density (:func:`plan_host_restore`).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import xxhash

from hpc_cli.cache.cost import GENERIC, CacheCostModel
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, MediaItem, lookup_hash
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.cache.tree import RESIDENT
from hpc_cli.errors import CacheFileError

MAGIC = b"HPCPFX\r\n"
FORMAT_VERSION = 2  # 2: snapshot tail media keys and the media table (Vision prompts)
ALIGN = 4096
RUN_MAX_BYTES = 64 << 20
_PRE = struct.Struct("<8sII")
_U64 = struct.Struct("<Q")
_BLOCK = struct.Struct("<iQQ")
BLOCK_RECORD = _BLOCK.size + 4 * BLOCK_TOKENS
_SNAP = struct.Struct("<iQBIHIQ")
_MEDIA = struct.Struct("<I32sIIIIQI")
_RUN = struct.Struct("<IIQ")
KINDS = [SnapshotKind.TAP, SnapshotKind.ENDPOINT, SnapshotKind.OUTPUT_BOUNDARY, SnapshotKind.BOUNDARY]
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
_HINT_DAMAGED = "the file is damaged; delete it (the next orderly stop writes a new one) or check the disk"

_xxh = xxhash.xxh3_64_intdigest


class SaveAbandoned(Exception):
    """The save stopped on the abandon flag; the temporary file is gone, the previous file stays."""


def _hex(v: int) -> str:
    return f"{v:016x}"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ------------------------------------------------------------------ slab I/O
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


# ------------------------------------------------------------------ records
@dataclass(slots=True)
class FileBlock:
    parent: int  # index into the block table, -1 for the root
    tokens: bytes
    extra: int
    hash: int
    slab: int = -1  # host slab id (export) or -1
    media: tuple[MediaItem, ...] = ()  # the Vision items whose tokens it holds (extra keys them)


@dataclass(slots=True)
class FileSnapshot:
    anchor: int  # index into the block table, -1 for the root
    frontier: int
    kind: SnapshotKind
    tail_tokens: bytes
    hits: int
    first_slab: int = 0  # first file slab
    host_slabs: tuple[int, ...] = ()  # export: host image slabs
    tail_host_slab: int = -1  # export: host tail slab
    tail_extra: int = 0  # media key of the Vision items in the tail (0: none)

    @property
    def has_tail(self) -> bool:
        return bool(self.tail_tokens)


@dataclass(slots=True)
class Geometry:
    slab_bytes: int
    image_bytes: int
    block_bytes: int

    @property
    def image_slabs(self) -> int:
        return -(-self.image_bytes // self.slab_bytes)

    def as_dict(self) -> dict[str, int]:
        return {"slab_bytes": self.slab_bytes, "image_bytes": self.image_bytes, "block_bytes": self.block_bytes}


@dataclass(slots=True)
class SavePlan:
    """What a save writes: the blocks (parents first) and the snapshots, with host slab ids."""

    blocks: list[FileBlock]
    snapshots: list[FileSnapshot]

    def host_slab_order(self) -> list[int]:
        out = [b.slab for b in self.blocks]
        for s in self.snapshots:
            out += list(s.host_slabs)
            if s.has_tail:
                out.append(s.tail_host_slab)
        return out


@dataclass(slots=True)
class CacheFile:
    """A cache file's header and tables, checked; the slab bytes are not read."""

    path: Path
    format: int
    meta: dict[str, Any]
    blocks: list[FileBlock]
    snapshots: list[FileSnapshot]
    runs: list[tuple[int, int, int]]  # (first slab, count, xxh3_64)
    slabs_offset: int
    file_size: int

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.meta["fingerprint"]

    @property
    def geometry(self) -> Geometry:
        g = self.meta["geometry"]
        return Geometry(g["slab_bytes"], g["image_bytes"], g["block_bytes"])

    @property
    def num_slabs(self) -> int:
        return self.meta["counts"]["slabs"]

    def snapshot_slabs(self, s: FileSnapshot) -> int:
        return self.geometry.image_slabs + (1 if s.has_tail else 0)

    def path_of(self, s: FileSnapshot) -> list[int]:
        """Block indices of the snapshot's anchor path, root side first."""
        out = []
        i = s.anchor
        while i >= 0:
            out.append(i)
            i = self.blocks[i].parent
        out.reverse()
        return out


# ------------------------------------------------------------------ export (§5.5 save subset)
def export_saveable(index: Any) -> SavePlan:
    """The retained, host-resident snapshots whose anchor paths are host-resident, and exactly
    those paths, parents first. Dead KV, superseded and device-only content are left out."""
    chosen: dict[Any, None] = {}
    snaps = []
    for s in index.snapshots.values():
        if not s.alive or s.superseded or s.host_state != RESIDENT:
            continue
        if s.tail_tokens and s.tail_host_state != RESIDENT:
            continue
        path = s.anchor.path()
        if any(n.host_state != RESIDENT for n in path):
            continue
        snaps.append(s)
        for n in path:
            chosen[n] = None
    nodes = sorted(chosen, key=lambda n: (n.depth, n.id))  # parents first
    pos = {n: i for i, n in enumerate(nodes)}
    blocks = [FileBlock(pos[n.parent] if not n.parent.is_root else -1, n.tokens, n.extra, n.hash, n.host_slab,
                        n.media) for n in nodes]
    out = []
    for s in sorted(snaps, key=lambda s: (s.frontier, s.id)):
        out.append(FileSnapshot(pos[s.anchor] if not s.anchor.is_root else -1, s.frontier, s.kind,
                                s.tail_tokens, s.hits, 0, tuple(s.host_slabs), s.tail_host_slab, s.tail_extra))
    return SavePlan(blocks, out)


# ------------------------------------------------------------------ writing
def _media_table(plan: SavePlan) -> bytes:
    mt = bytearray()
    for i, b in enumerate(plan.blocks):
        for it in b.media:
            t, h, w = (tuple(it.grid) + (1, 1, 1))[:3]
            mt += _MEDIA.pack(i, it.content_digest, it.modality, t, h, w, it.begin, it.length)
    return bytes(mt)


def _tables(plan: SavePlan, geom: Geometry) -> tuple[bytes, bytes, list[tuple[int, int]]]:
    bt = bytearray()
    for b in plan.blocks:
        assert len(b.tokens) == 4 * BLOCK_TOKENS
        bt += _BLOCK.pack(b.parent, b.extra & (2**64 - 1), b.hash) + b.tokens
    st = bytearray()
    slab = len(plan.blocks)
    runs: list[tuple[int, int]] = [(i, 1) for i in range(len(plan.blocks))]
    per_run = max(1, RUN_MAX_BYTES // geom.slab_bytes)
    for s in plan.snapshots:
        s.first_slab = slab
        n = geom.image_slabs + (1 if s.has_tail else 0)
        st += _SNAP.pack(s.anchor, s.frontier, _KIND_CODE[s.kind], min(s.hits, 2**32 - 1),
                         len(s.tail_tokens) // 4, slab, s.tail_extra & (2**64 - 1)) + s.tail_tokens
        for k in range(0, n, per_run):
            runs.append((slab + k, min(per_run, n - k)))
        slab += n
    return bytes(bt), bytes(st), runs


def _meta(fingerprint: dict, geom: Geometry, plan: SavePlan, nslabs: int, nruns: int, offsets: dict,
          sums: dict) -> bytes:
    meta = {
        "fingerprint": fingerprint,
        "geometry": {**geom.as_dict(), "image_slabs": geom.image_slabs},
        "counts": {"blocks": len(plan.blocks), "snapshots": len(plan.snapshots), "slabs": nslabs, "runs": nruns},
        "sections": {k: [offsets[k][0], offsets[k][1], sums.get(k, "0" * 16)] for k in offsets},
        "saved_at": 0,
    }
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def write_cache_file(f: BinaryIO, fingerprint: dict, geom: Geometry, plan: SavePlan,
                     read_slab: Callable[[int], Any], *, abandon: threading.Event | None = None,
                     on_bytes: Callable[[int], None] | None = None) -> int:
    """Write the file to ``f`` (opened ``wb``, seekable); returns its size. ``read_slab(host_slab)``
    gives one slab's bytes (a buffer of ``slab_bytes``). ``abandon`` is checked before every slab
    run: once set, :class:`SaveAbandoned` is raised."""
    bt, st, runs = _tables(plan, geom)
    mt = _media_table(plan)
    order = plan.host_slab_order()
    nslabs = len(order)
    rt_len = _RUN.size * len(runs)

    def layout(meta_len: int) -> dict:
        head = _PRE.size + meta_len + 8
        o_b = head
        o_s = o_b + len(bt)
        o_m = o_s + len(st)
        o_r = o_m + len(mt)
        o_sl = _align(o_r + rt_len)
        return {"blocks": (o_b, len(bt)), "snapshots": (o_s, len(st)), "media": (o_m, len(mt)),
                "runs": (o_r, rt_len), "slabs": (o_sl, nslabs * geom.slab_bytes)}

    # the meta's length depends on the offsets it holds: iterate to a fixed point
    meta_len = 0
    for _ in range(8):
        offs = layout(meta_len)
        m = _meta(fingerprint, geom, plan, nslabs, len(runs), offs, {})
        if len(m) == meta_len:
            break
        meta_len = len(m)
    offs = layout(meta_len)
    sums = {"blocks": _hex(_xxh(bt)), "snapshots": _hex(_xxh(st)), "media": _hex(_xxh(mt)), "runs": "0" * 16}
    m = _meta(fingerprint, geom, plan, nslabs, len(runs), offs, sums)
    assert len(m) == meta_len
    f.write(_PRE.pack(MAGIC, FORMAT_VERSION, meta_len) + m + b"\0" * 8)
    f.write(bt)
    f.write(st)
    f.write(mt)
    f.write(b"\0" * rt_len)
    f.write(b"\0" * (offs["slabs"][0] - (offs["runs"][0] + rt_len)))
    sb = geom.slab_bytes
    # file slab i's bytes, tagged with its run; written many slabs per writev straight from the
    # host storage while a helper thread checksums them
    tagged: list[tuple[int, memoryview]] = []
    for k, (first, count) in enumerate(runs):
        for i in range(first, first + count):
            tagged.append((k, _bytes_view(read_slab(order[i]), sb, f"slab {order[i]}")))
    try:
        fd = f.fileno()
        f.flush()
    except (AttributeError, OSError, ValueError):  # not a real file (BytesIO): plain writes
        fd = None
    hasher = _Hasher(len(runs))
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
    run_sums = [_RUN.pack(first, count, sums_k[k]) for k, (first, count) in enumerate(runs)]
    rt = b"".join(run_sums)
    f.seek(offs["runs"][0])
    f.write(rt)
    sums["runs"] = _hex(_xxh(rt))
    m2 = _meta(fingerprint, geom, plan, nslabs, len(runs), offs, sums)
    assert len(m2) == meta_len
    head = _PRE.pack(MAGIC, FORMAT_VERSION, meta_len) + m2
    f.seek(0)
    f.write(head + _U64.pack(_xxh(head)))
    f.seek(0, os.SEEK_END)
    return offs["slabs"][0] + nslabs * sb


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
def _damaged(path: Path, why: str) -> CacheFileError:
    return CacheFileError(f"prefix cache file {path} is damaged: {why}", hint=_HINT_DAMAGED)


def _read_exact(f: BinaryIO, n: int, path: Path, what: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _damaged(path, f"truncated in the {what}")
    return b


def open_cache_file(path: str | Path) -> CacheFile:
    """Read and check the header and tables (checksums, structure, size). Raises CacheFileError."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CacheFileError(f"prefix cache file {path} does not exist",
                             hint="the server writes it at an orderly stop") from None
    except OSError as exc:
        raise CacheFileError(f"cannot read prefix cache file {path}: {exc}", hint="check its permissions") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        pre = _read_exact(f, _PRE.size, path, "header")
        magic, version, meta_len = _PRE.unpack(pre)
        if magic != MAGIC:
            raise CacheFileError(f"{path} is not a prefix cache file (bad magic)",
                                 hint="point --prefix-cache-file at a file written by hpc-cli, or a new path")
        if version != FORMAT_VERSION:
            raise CacheFileError(f"prefix cache file {path} has format {version}; this version reads {FORMAT_VERSION}",
                                 hint="delete it; the next orderly stop writes the current format")
        if meta_len > size or meta_len > (64 << 20):
            raise _damaged(path, "header length exceeds the file")
        meta_b = _read_exact(f, meta_len, path, "header")
        (hsum,) = _U64.unpack(_read_exact(f, 8, path, "header"))
        if _xxh(pre + meta_b) != hsum:
            raise _damaged(path, "header checksum mismatch")
        try:
            meta = json.loads(meta_b)
            if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), dict):  # a crafted header
                raise TypeError("the fingerprint is missing or not an object")
            geom = meta["geometry"]
            counts = meta["counts"]
            secs = meta["sections"]
            sb, ib = int(geom["slab_bytes"]), int(geom["image_bytes"])
            nb, ns, nslabs, nruns = (int(counts[k]) for k in ("blocks", "snapshots", "slabs", "runs"))
            sec = {k: (int(secs[k][0]), int(secs[k][1]), str(secs[k][2]))
                   for k in ("blocks", "snapshots", "media", "runs", "slabs")}
            isl = -(-ib // sb)
        except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError, RecursionError) as exc:
            raise _damaged(path, f"header unreadable ({exc})") from None
        expect = sec["slabs"][0] + nslabs * sb
        if size != expect:
            raise _damaged(path, f"size {size} B, its tables say {expect} B (truncated or extended)")
        tabs = {}
        pad_at = sec["runs"][0] + sec["runs"][1]
        if not (pad_at <= sec["slabs"][0] < pad_at + ALIGN) or sec["blocks"][0] != _PRE.size + meta_len + 8 \
                or sec["snapshots"][0] != sum(sec["blocks"][:2]) or sec["media"][0] != sum(sec["snapshots"][:2]) \
                or sec["runs"][0] != sum(sec["media"][:2]):
            raise _damaged(path, "section offsets malformed")
        f.seek(pad_at)
        if any(_read_exact(f, sec["slabs"][0] - pad_at, path, "padding")):
            raise _damaged(path, "nonzero padding before the slab section")
        for k in ("blocks", "snapshots", "media", "runs"):
            off, ln, want = sec[k]
            f.seek(off)
            data = _read_exact(f, ln, path, f"{k} table")
            if _hex(_xxh(data)) != want:
                raise _damaged(path, f"{k} table checksum mismatch")
            tabs[k] = data
    # structure (checksums passed; this guards against a writer bug, not against damage)
    bad = lambda why: _damaged(path, why)  # noqa: E731
    bt = tabs["blocks"]
    if len(bt) != nb * BLOCK_RECORD:
        raise bad("block table length")
    blocks = []
    for i in range(nb):
        o = i * BLOCK_RECORD
        parent, extra, h = _BLOCK.unpack_from(bt, o)
        toks = bt[o + _BLOCK.size:o + BLOCK_RECORD]
        if not -1 <= parent < i:
            raise bad(f"block {i} has parent {parent} (parents come first)")
        ph = blocks[parent].hash if parent >= 0 else HASH_SEED
        if lookup_hash(ph, toks, extra) != h:
            raise bad(f"block {i}: lookup hash does not match its tokens")
        blocks.append(FileBlock(parent, toks, extra, h))
    st = tabs["snapshots"]
    snaps = []
    o = 0
    depth_end = lambda a: BLOCK_TOKENS * (_depth(blocks, a) + 1)  # noqa: E731
    for j in range(ns):
        if o + _SNAP.size > len(st):
            raise bad("snapshot table length")
        anchor, frontier, kind, hits, tl, first, tail_extra = _SNAP.unpack_from(st, o)
        o += _SNAP.size
        tail = st[o:o + 4 * tl]
        o += 4 * tl
        if len(tail) != 4 * tl or kind >= len(KINDS) or not -1 <= anchor < nb or tl >= BLOCK_TOKENS:
            raise bad(f"snapshot {j} malformed")
        if frontier != depth_end(anchor) + tl or frontier == 0:
            raise bad(f"snapshot {j}: frontier {frontier} does not match its anchor")
        if first + isl + (1 if tl else 0) > nslabs or first < nb:
            raise bad(f"snapshot {j}: slabs out of range")
        snaps.append(FileSnapshot(anchor, frontier, KINDS[kind], tail, hits, first, tail_extra=tail_extra))
    if o != len(st):
        raise bad("snapshot table length")
    mt = tabs["media"]
    if len(mt) % _MEDIA.size:
        raise bad("media table length")
    media: dict[int, list[MediaItem]] = {}
    for k in range(0, len(mt), _MEDIA.size):
        i, digest, modality, t, h, w, begin, length = _MEDIA.unpack_from(mt, k)
        if i >= nb or not blocks[i].extra:
            raise bad(f"media record {k // _MEDIA.size} names block {i}, which has no media key")
        lo = BLOCK_TOKENS * _depth(blocks, i)
        hi = lo + BLOCK_TOKENS
        if not (begin < hi and begin + length > lo):
            raise bad(f"media record {k // _MEDIA.size}: span [{begin}, {begin + length}) is not in block {i}")
        media.setdefault(i, []).append(MediaItem(digest, modality, (t, h, w), begin, length))
    for i, items in media.items():
        blocks[i].media = tuple(items)
    rt = tabs["runs"]
    if len(rt) != nruns * _RUN.size:
        raise bad("run table length")
    runs = [_RUN.unpack_from(rt, k * _RUN.size) for k in range(nruns)]
    nxt = 0
    for first, count, _ in runs:
        if first != nxt or count < 1:
            raise bad("slab runs do not cover the slab section in order")
        nxt += count
    if nxt != nslabs:
        raise bad("slab runs do not cover the slab section")
    return CacheFile(path, version, meta, blocks, snaps, runs, sec["slabs"][0], size)


def _depth(blocks: list[FileBlock], i: int) -> int:
    d = -1
    while i >= 0:
        d += 1
        i = blocks[i].parent
    return d


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


# ------------------------------------------------------------------ matching
def fingerprint_diff(saved: dict, running: dict) -> list[str]:
    """Keys whose values differ (the reasons a file does not load)."""
    keys = sorted(set(saved) | set(running))
    return [k for k in keys if saved.get(k) != running.get(k)]


def geometry_diff(saved: Geometry, running: Geometry) -> list[str]:
    return [k for k, v in saved.as_dict().items() if running.as_dict()[k] != v]


# ------------------------------------------------------------------ restore planning
def density(cf: CacheFile, s: FileSnapshot, cost: CacheCostModel = GENERIC) -> float:
    """(1 + hits) x the prefill a restore saves from the root, per byte of image, tail and path."""
    g = cf.geometry
    nbytes = g.image_bytes + (g.block_bytes if s.has_tail else 0) + g.block_bytes * (_depth(cf.blocks, s.anchor) + 1)
    return (1 + s.hits) * cost.prefill_seconds(0, s.frontier) / max(1, nbytes)


@dataclass(slots=True)
class RestorePlan:
    snapshots: list[int]  # indices into cf.snapshots, file order
    blocks: list[int]  # indices into cf.blocks, parents first
    slabs: int  # host slabs the plan takes
    total_slabs: int  # what the whole file needs
    complete: bool


def plan_host_restore(cf: CacheFile, free_slabs: int, cost: CacheCostModel = GENERIC) -> RestorePlan:
    """Whole snapshots, greedily by :func:`density`, each with the path blocks it needs and no
    others, within ``free_slabs``."""
    per = {j: cf.snapshot_slabs(s) for j, s in enumerate(cf.snapshots)}
    used = len(cf.blocks) + sum(per.values())
    if used <= free_slabs:
        return RestorePlan(list(range(len(cf.snapshots))), list(range(len(cf.blocks))), used, used, True)
    order = sorted(range(len(cf.snapshots)),
                   key=lambda j: (-density(cf, cf.snapshots[j], cost), -cf.snapshots[j].frontier, j))
    have: set[int] = set()
    take: list[int] = []
    left = free_slabs
    for j in order:
        path = [i for i in cf.path_of(cf.snapshots[j]) if i not in have]
        need = per[j] + len(path)
        if need <= left:
            left -= need
            have.update(path)
            take.append(j)
    take.sort()
    return RestorePlan(take, sorted(have), free_slabs - left, used, len(take) == len(cf.snapshots))


# ------------------------------------------------------------------ loading
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
                        raise _damaged(cf.path, f"slab run {tagged[at][0]} truncated")
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
                raise _damaged(cf.path, f"slab run {k} (file slabs {first}..{first + count - 1}) checksum mismatch")
    return mapping


def adopt_plan(index: Any, cf: CacheFile, plan: RestorePlan, mapping: dict[int, int]) -> tuple[int, int]:
    """Rebuild the plan's entries in ``index`` host-only, parents first (no eviction)."""
    nodes: dict[int, Any] = {}
    root = index.tree.root
    for i in plan.blocks:
        b = cf.blocks[i]
        parent = nodes[b.parent] if b.parent >= 0 else root
        nodes[i] = index.adopt_host_node(parent, b.tokens, b.extra, mapping[i], h=b.hash, media=b.media)
    isl = cf.geometry.image_slabs
    for j in plan.snapshots:
        s = cf.snapshots[j]
        anchor = nodes[s.anchor] if s.anchor >= 0 else root
        image = tuple(mapping[s.first_slab + k] for k in range(isl))
        tail = mapping[s.first_slab + isl] if s.has_tail else -1
        index.adopt_host_snapshot(anchor, s.frontier, s.kind, tail_tokens=s.tail_tokens, hits=s.hits,
                                  image_slabs=image, tail_slab=tail, tail_extra=s.tail_extra)
    return len(plan.blocks), len(plan.snapshots)


# ------------------------------------------------------------------ summary (inspect)
def summarize(cf: CacheFile, *, top: int = 10, cost: CacheCostModel = GENERIC) -> dict[str, Any]:
    g = cf.geometry
    by_kind: dict[str, dict[str, int]] = {}
    for s in cf.snapshots:
        d = by_kind.setdefault(s.kind.value, {"count": 0, "bytes": 0, "tailed": 0})
        d["count"] += 1
        d["bytes"] += cf.snapshot_slabs(s) * g.slab_bytes
        d["tailed"] += 1 if s.has_tail else 0
    children: dict[int, int] = {}
    depth = [0] * len(cf.blocks)
    for i, b in enumerate(cf.blocks):
        children[b.parent] = children.get(b.parent, 0) + 1
        depth[i] = depth[b.parent] + 1 if b.parent >= 0 else 1
    inner = [c for c in children.values()]
    ranked = sorted(range(len(cf.snapshots)), key=lambda j: -density(cf, cf.snapshots[j], cost))[:top]
    return {
        "path": str(cf.path), "format": cf.format, "file_bytes": cf.file_size,
        "fingerprint": cf.fingerprint, "geometry": {**g.as_dict(), "image_slabs": g.image_slabs},
        "blocks": {"count": len(cf.blocks), "bytes": len(cf.blocks) * g.slab_bytes},
        "snapshots": {"count": len(cf.snapshots), "by_kind": by_kind,
                      "bytes": sum(cf.snapshot_slabs(s) for s in cf.snapshots) * g.slab_bytes},
        "slabs": cf.num_slabs, "slab_bytes_total": cf.num_slabs * g.slab_bytes,
        "tree": {"depth_blocks": max(depth, default=0), "roots": children.get(-1, 0),
                 "max_fanout": max(inner, default=0),
                 "branching_nodes": sum(1 for c in inner if c > 1),
                 "leaves": len(cf.blocks) - sum(1 for k in children if k >= 0)},
        "top_snapshots": [{"index": j, "kind": cf.snapshots[j].kind.value, "frontier": cf.snapshots[j].frontier,
                           "hits": cf.snapshots[j].hits, "density": density(cf, cf.snapshots[j], cost)}
                          for j in ranked],
        "media": media_summary(cf, top=top),
    }


def media_summary(cf: CacheFile, *, top: int = 10) -> dict[str, Any]:
    """The Vision items the file's blocks hold, by content digest, and the snapshots whose tails
    carry a media key."""
    images: dict[bytes, dict[str, Any]] = {}
    keyed = 0
    for i, b in enumerate(cf.blocks):
        keyed += 1 if b.media else 0
        for it in b.media:
            d = images.setdefault(it.content_digest, {"digest": it.content_digest.hex(), "modality": it.modality,
                                                      "grid": list(it.grid), "spans": [], "blocks": []})
            if [it.begin, it.length] not in d["spans"]:
                d["spans"].append([it.begin, it.length])
            d["blocks"].append(i)
    items = sorted(images.values(), key=lambda d: (-len(d["blocks"]), d["digest"]))
    return {"blocks": keyed, "images": len(images),
            "tail_keyed_snapshots": sum(1 for s in cf.snapshots if s.tail_extra),
            "items": [{**d, "media_keys": sorted({_hex(cf.blocks[i].extra) for i in d["blocks"]})[:top]}
                      for d in items[:top]]}


def fmt_rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / (1 << 30):.2f} GiB/s"


def now() -> float:
    return time.perf_counter()


def iter_tree_lines(cf: CacheFile, limit: int = 200) -> Iterable[str]:
    """A text view of the block tree (block index, depth, snapshots anchored)."""
    kids: dict[int, list[int]] = {}
    for i, b in enumerate(cf.blocks):
        kids.setdefault(b.parent, []).append(i)
    anchored: dict[int, list[FileSnapshot]] = {}
    for s in cf.snapshots:
        anchored.setdefault(s.anchor, []).append(s)
    lines = 0

    def label(i: int) -> str:
        sn = anchored.get(i, [])
        tag = ", ".join(f"{s.kind.value}@{s.frontier}(hits {s.hits})" for s in sn)
        media = " ".join(f"[image {it.content_digest.hex()[:12]}]" for it in cf.blocks[i].media)
        return f"block {i}" + (f"  {media}" if media else "") + (f"  ({tag})" if tag else "")

    stack = [(i, 0) for i in reversed(kids.get(-1, []))]
    for s in anchored.get(-1, []):
        yield f"root  ({s.kind.value}@{s.frontier})"
    while stack and lines < limit:
        i, d = stack.pop()
        ch = kids.get(i, [])
        # compress single chains without snapshots
        run = 0
        while len(ch) == 1 and i not in anchored:
            i = ch[0]
            ch = kids.get(i, [])
            run += 1
        yield "  " * d + ("… " + f"+{run} blocks → " if run else "") + label(i)
        lines += 1
        stack += [(c, d + 1) for c in reversed(ch)]
    if stack:
        yield f"… ({len(stack)} more branches)"
