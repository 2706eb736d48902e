"""The prefix cache file's format (spec §5.5; format in docs/prefix-cache-file.md). Pure Python.

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

This module is the layout: its records, a save's header and tables (:class:`FileLayout`, the
slab bytes are :mod:`~hpc_cli.cache.cachefile.slab_io`'s) and reading them back, checked
(:func:`open_cache_file`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, MediaItem, lookup_hash
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.errors import CacheFileError

MAGIC = b"HPCPFX\r\n"
FORMAT_VERSION = 2  # 2: snapshot tail media keys and the media table (Vision prompts)
ALIGN = 4096
RUN_MAX_BYTES = 64 << 20
PREAMBLE = struct.Struct("<8sII")  # magic, format, meta length
U64 = struct.Struct("<Q")
_BLOCK = struct.Struct("<iQQ")
BLOCK_RECORD = _BLOCK.size + 4 * BLOCK_TOKENS
_SNAP = struct.Struct("<iQBIHIQ")
_MEDIA = struct.Struct("<I32sIIIIQI")
_RUN = struct.Struct("<IIQ")
KINDS = [SnapshotKind.TAP, SnapshotKind.ENDPOINT, SnapshotKind.OUTPUT_BOUNDARY, SnapshotKind.BOUNDARY]
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
HINT_DAMAGED = "the file is damaged; delete it (the next orderly stop writes a new one) or check the disk"

#: the checksum of the header, each table and each slab run
xxh3_64 = xxhash.xxh3_64_intdigest


def _hex(v: int) -> str:
    return f"{v:016x}"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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


@dataclass(slots=True)
class FileLayout:
    """Everything a save writes but the slab bytes: the tables, the slab runs, where each section
    sits and the meta's length. :meth:`head` is the file up to the slab section with the run table
    and the header checksum zero; :meth:`seal` gives both once the runs' digests are known."""

    fingerprint: dict
    geom: Geometry
    plan: SavePlan
    tables: tuple[bytes, bytes, bytes]  # blocks, snapshots, media
    runs: list[tuple[int, int]]  # (first file slab, count)
    order: list[int]  # host slab of each file slab
    offsets: dict[str, tuple[int, int]]
    meta_len: int
    sums: dict[str, str]

    @property
    def slabs_offset(self) -> int:
        return self.offsets["slabs"][0]

    @property
    def size(self) -> int:
        return self.slabs_offset + len(self.order) * self.geom.slab_bytes

    def _meta_bytes(self, sums: dict) -> bytes:
        m = _meta(self.fingerprint, self.geom, self.plan, len(self.order), len(self.runs), self.offsets, sums)
        assert len(m) == self.meta_len
        return m

    def head(self) -> bytes:
        rt_len = _RUN.size * len(self.runs)
        pad = self.slabs_offset - (self.offsets["runs"][0] + rt_len)
        return b"".join((PREAMBLE.pack(MAGIC, FORMAT_VERSION, self.meta_len), self._meta_bytes(self.sums), b"\0" * 8,
                         *self.tables, b"\0" * rt_len, b"\0" * pad))

    def seal(self, run_digests: list[int]) -> tuple[int, bytes, bytes]:
        """(the run table's offset, the run table, the header with its checksum)."""
        rt = b"".join(_RUN.pack(first, count, run_digests[k]) for k, (first, count) in enumerate(self.runs))
        sums = {**self.sums, "runs": _hex(xxh3_64(rt))}
        head = PREAMBLE.pack(MAGIC, FORMAT_VERSION, self.meta_len) + self._meta_bytes(sums)
        return self.offsets["runs"][0], rt, head + U64.pack(xxh3_64(head))


def layout_file(fingerprint: dict, geom: Geometry, plan: SavePlan) -> FileLayout:
    """Encode ``plan``'s tables (assigning each snapshot its first file slab) and place the
    sections."""
    bt, st, runs = _tables(plan, geom)
    mt = _media_table(plan)
    order = plan.host_slab_order()
    nslabs = len(order)
    rt_len = _RUN.size * len(runs)

    def layout(meta_len: int) -> dict:
        head = PREAMBLE.size + meta_len + 8
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
    sums = {"blocks": _hex(xxh3_64(bt)), "snapshots": _hex(xxh3_64(st)), "media": _hex(xxh3_64(mt)), "runs": "0" * 16}
    return FileLayout(fingerprint, geom, plan, (bt, st, mt), runs, order, offs, meta_len, sums)


# ------------------------------------------------------------------ reading
def damaged(path: Path, why: str) -> CacheFileError:
    return CacheFileError(f"prefix cache file {path} is damaged: {why}", hint=HINT_DAMAGED)


def _read_exact(f: BinaryIO, n: int, path: Path, what: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise damaged(path, f"truncated in the {what}")
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
        pre = _read_exact(f, PREAMBLE.size, path, "header")
        magic, version, meta_len = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise CacheFileError(f"{path} is not a prefix cache file (bad magic)",
                                 hint="point --prefix-cache-file at a file written by hpc-cli, or a new path")
        if version != FORMAT_VERSION:
            raise CacheFileError(f"prefix cache file {path} has format {version}; this version reads {FORMAT_VERSION}",
                                 hint="delete it; the next orderly stop writes the current format")
        if meta_len > size or meta_len > (64 << 20):
            raise damaged(path, "header length exceeds the file")
        meta_b = _read_exact(f, meta_len, path, "header")
        (hsum,) = U64.unpack(_read_exact(f, 8, path, "header"))
        if xxh3_64(pre + meta_b) != hsum:
            raise damaged(path, "header checksum mismatch")
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
            raise damaged(path, f"header unreadable ({exc})") from None
        expect = sec["slabs"][0] + nslabs * sb
        if size != expect:
            raise damaged(path, f"size {size} B, its tables say {expect} B (truncated or extended)")
        tabs = {}
        pad_at = sec["runs"][0] + sec["runs"][1]
        if not (pad_at <= sec["slabs"][0] < pad_at + ALIGN) or sec["blocks"][0] != PREAMBLE.size + meta_len + 8 \
                or sec["snapshots"][0] != sum(sec["blocks"][:2]) or sec["media"][0] != sum(sec["snapshots"][:2]) \
                or sec["runs"][0] != sum(sec["media"][:2]):
            raise damaged(path, "section offsets malformed")
        f.seek(pad_at)
        if any(_read_exact(f, sec["slabs"][0] - pad_at, path, "padding")):
            raise damaged(path, "nonzero padding before the slab section")
        for k in ("blocks", "snapshots", "media", "runs"):
            off, ln, want = sec[k]
            f.seek(off)
            data = _read_exact(f, ln, path, f"{k} table")
            if _hex(xxh3_64(data)) != want:
                raise damaged(path, f"{k} table checksum mismatch")
            tabs[k] = data
    # structure (checksums passed; this guards against a writer bug, not against damage)
    bad = lambda why: damaged(path, why)  # noqa: E731
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
    depth_end = lambda a: BLOCK_TOKENS * (block_depth(blocks, a) + 1)  # noqa: E731
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
        lo = BLOCK_TOKENS * block_depth(blocks, i)
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


def block_depth(blocks: list[FileBlock], i: int) -> int:
    d = -1
    while i >= 0:
        d += 1
        i = blocks[i].parent
    return d


# ------------------------------------------------------------------ matching
def fingerprint_diff(saved: dict, running: dict) -> list[str]:
    """Keys whose values differ (the reasons a file does not load)."""
    keys = sorted(set(saved) | set(running))
    return [k for k in keys if saved.get(k) != running.get(k)]


def geometry_diff(saved: Geometry, running: Geometry) -> list[str]:
    return [k for k, v in saved.as_dict().items() if running.as_dict()[k] != v]


