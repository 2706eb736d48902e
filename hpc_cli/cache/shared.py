"""Keys and records of the shared cache tier (L3, docs/shared-cache.md). Pure Python.

The shared tier keeps, in a store several replicas reach (Redis), the same entries as the host
tier: block bundles, content-addressed by their chained lookup hash (spec §5.1), and snapshots
(state image and tail bundle), keyed by their anchor's lookup hash and their frontier. Every key
lives in a *namespace*: 32 hex digits of SHA-256 over the engine's fingerprint (spec §5.5, the one
the prefix cache file carries: checkpoint, prefill signature, KV profile and its global scales,
speculative backend, RoPE fields, product build) and its host geometry, so two engines read each
other's entries only when their bytes would be the same::

    block     {ns}:b:{lookup_hash:016x}
    snapshot  {ns}:s:{anchor lookup_hash:016x}:{frontier}:{tail digest:016x}
    anchors   {ns}:a:{anchor lookup_hash:016x}      set of b"{frontier}:{tail digest:016x}"

A lookup hash selects; it never decides equality. Each record also carries its exact tokens and
extra key, and a 128-bit *path digest* (xxh3_128 chained over every block's tokens and extra key
from the root, :func:`path_digest`) that stands for the whole path above it, which the tier's
lookups compare with the prompt's own. Record layout, little-endian::

    magic "HPCL3\\0" (6 B), u16 format, u8 type (1 block, 2 snapshot), u8 snapshot kind,
    u16 0, 16 B namespace digest, u64 hash (block: its lookup hash; snapshot: its anchor's),
    u64 parent lookup hash (block) or frontier (snapshot), u64 extra (block) or hits (snapshot),
    16 B path digest (block: its path; snapshot: its anchor's), u32 token bytes,
    u64 first payload bytes, u64 second payload bytes
    tokens      (a block: 256 B; a snapshot: its tail tokens, 4 B each)
    payloads    a block: its bundle record; a snapshot: its state image, then its tail bundle
    u64 xxh3_64 of everything before it

A record that is missing, of another namespace or format, of the wrong size, damaged (checksum)
or for other tokens is a miss (:class:`RecordError`), never data.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, NewType, Sequence

import xxhash

from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, PreparedPrompt
from hpc_cli.cache.snapshot import SnapshotKind

FORMAT = 1
MAGIC = b"HPCL3\0"
_HEAD = struct.Struct("<6sHBBH16sQQQ16sIQQ")
HEADER_BYTES = _HEAD.size
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1
TYPE_BLOCK, TYPE_SNAPSHOT = 1, 2
KINDS = (SnapshotKind.TAP, SnapshotKind.ENDPOINT, SnapshotKind.OUTPUT_BOUNDARY, SnapshotKind.BOUNDARY)
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}

#: ``{ns}``: "hpc1:" and 32 hex digits
Namespace = NewType("Namespace", str)
#: a key of the store
StoreKey = NewType("StoreKey", str)
#: 16 bytes: xxh3_128 chained over a path's blocks
PathDigest = NewType("PathDigest", bytes)

#: the path digest of the root (no block)
ROOT_PATH = PathDigest(xxhash.xxh3_128_digest(b"HPC-PATH" + HASH_SEED.to_bytes(8, "little")))


class Miss(Enum):
    """Why a value was not used."""

    MISSING = "missing"  # no value under the key (never written, evicted, lost in a restart)
    STALE = "stale"  # another namespace or format under the key
    DAMAGED = "damaged"  # wrong size or checksum
    COLLISION = "collision"  # the key's hash matched, the tokens or path did not


class RecordError(Exception):
    """A value that is not the entry asked for; ``miss`` says why."""

    def __init__(self, miss: Miss, why: str) -> None:
        super().__init__(why)
        self.miss = miss


# ------------------------------------------------------------------ namespace, keys, digests
def namespace(fingerprint: Mapping[str, object], geometry: Mapping[str, int]) -> Namespace:
    """The namespace of an engine: SHA-256 over the canonical JSON of both."""
    doc = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "geometry": dict(geometry)},
                     sort_keys=True, separators=(",", ":"), default=str)
    return Namespace("hpc1:" + hashlib.sha256(doc.encode()).hexdigest()[:32])


def namespace_digest(ns: Namespace) -> bytes:
    """The 16 bytes a record carries for its namespace."""
    return bytes.fromhex(ns.split(":", 1)[1])


def block_key(ns: Namespace, lookup_hash: int) -> StoreKey:
    return StoreKey(f"{ns}:b:{lookup_hash & _MASK64:016x}")


def snapshot_key(ns: Namespace, anchor_hash: int, frontier: int, tail: int) -> StoreKey:
    return StoreKey(f"{ns}:s:{anchor_hash & _MASK64:016x}:{frontier}:{tail & _MASK64:016x}")


def anchor_key(ns: Namespace, anchor_hash: int) -> StoreKey:
    return StoreKey(f"{ns}:a:{anchor_hash & _MASK64:016x}")


def tail_digest(tail_tokens: bytes) -> int:
    """The 64-bit digest of a snapshot's tail tokens (in its key and its anchor's set)."""
    return xxhash.xxh3_64_intdigest(b"HPC-TAIL" + tail_tokens)


def anchor_member(frontier: int, tail: int) -> bytes:
    return b"%d:%016x" % (frontier, tail & _MASK64)


def parse_member(member: bytes) -> tuple[int, int] | None:
    """(frontier, tail digest) of an anchor set member, or None for a malformed one."""
    try:
        f, t = member.split(b":")
        return int(f), int(t, 16)
    except ValueError:
        return None


def path_digest(parent: PathDigest, tokens: bytes, extra: int) -> PathDigest:
    """One step of the path digest chain: xxh3_128(parent || tokens || le64(extra))."""
    return PathDigest(xxhash.xxh3_128_digest(parent + tokens + (extra & _MASK64).to_bytes(8, "little")))


def path_digests(prompt: PreparedPrompt, blocks: int) -> list[PathDigest]:
    """The path digest of each of the prompt's first ``blocks`` full blocks."""
    out: list[PathDigest] = []
    d = ROOT_PATH
    for b in range(min(blocks, len(prompt.blocks))):
        d = path_digest(d, prompt.blocks[b], prompt.extras[b])
        out.append(d)
    return out


# ------------------------------------------------------------------ records
@dataclass(frozen=True, slots=True)
class BlockEntry:
    """A block as the tier writes it: its key fields and its bundle record's bytes."""

    lookup_hash: int
    parent_hash: int
    extra: int
    tokens: bytes  # 256 B
    path: PathDigest
    payload: bytes | memoryview


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """A snapshot as the tier writes it: anchor, frontier, tail, kind, and its bytes."""

    anchor_hash: int
    anchor_path: PathDigest
    frontier: int
    kind: SnapshotKind
    hits: int
    tail_tokens: bytes
    image: bytes | memoryview
    tail: bytes | memoryview  # the tail bundle record, b"" without a tail

    @property
    def tail_key(self) -> int:
        return tail_digest(self.tail_tokens)


@dataclass(frozen=True, slots=True)
class SnapshotPayload:
    """What a verified snapshot record gives: its kind, hits and bytes (views into the value)."""

    kind: SnapshotKind
    hits: int
    image: memoryview
    tail: memoryview


def _encode(ns: Namespace, rtype: int, kind: int, h: int, a: int, b: int, path: bytes, tokens: bytes,
            p1: bytes | memoryview, p2: bytes | memoryview) -> bytes:
    head = _HEAD.pack(MAGIC, FORMAT, rtype, kind, 0, namespace_digest(ns), h & _MASK64, a & _MASK64,
                      b & _MASK64, path, len(tokens), len(p1), len(p2))
    hasher = xxhash.xxh3_64()
    for part in (head, tokens, p1, p2):
        hasher.update(part)
    return b"".join((head, tokens, p1, p2, _U64.pack(hasher.intdigest())))


def encode_block(ns: Namespace, e: BlockEntry) -> bytes:
    assert len(e.tokens) == 4 * BLOCK_TOKENS, "a block has 64 tokens"
    return _encode(ns, TYPE_BLOCK, 0, e.lookup_hash, e.parent_hash, e.extra, e.path, e.tokens, e.payload, b"")


def encode_snapshot(ns: Namespace, e: SnapshotEntry) -> bytes:
    assert len(e.tail_tokens) == 4 * (e.frontier % BLOCK_TOKENS), "tail tokens and frontier disagree"
    assert bool(e.tail) == bool(e.tail_tokens), "a tail bundle iff the snapshot has a tail"
    return _encode(ns, TYPE_SNAPSHOT, _KIND_CODE[e.kind], e.anchor_hash, e.frontier, e.hits, e.anchor_path,
                   e.tail_tokens, e.image, e.tail)


@dataclass(frozen=True, slots=True)
class _Parsed:
    rtype: int
    kind: int
    h: int
    a: int
    b: int
    path: bytes
    tokens: memoryview
    p1: memoryview
    p2: memoryview


def _parse(ns: Namespace, raw: bytes | None) -> _Parsed:
    if raw is None:
        raise RecordError(Miss.MISSING, "no value")
    mv = memoryview(raw)
    if len(mv) < HEADER_BYTES + _U64.size:
        raise RecordError(Miss.DAMAGED, f"{len(mv)} bytes, shorter than a header")
    magic, fmt, rtype, kind, _, nsd, h, a, b, path, nt, n1, n2 = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RecordError(Miss.DAMAGED, "bad magic")
    if fmt != FORMAT:
        raise RecordError(Miss.STALE, f"format {fmt}, this build reads {FORMAT}")
    if nsd != namespace_digest(ns):
        raise RecordError(Miss.STALE, "another engine's namespace")
    end = HEADER_BYTES + nt + n1 + n2
    if len(mv) != end + _U64.size:
        raise RecordError(Miss.DAMAGED, f"{len(mv)} bytes, the header says {end + _U64.size}")
    if xxhash.xxh3_64_intdigest(mv[:end]) != _U64.unpack_from(mv, end)[0]:
        raise RecordError(Miss.DAMAGED, "checksum mismatch")
    o = HEADER_BYTES
    return _Parsed(rtype, kind, h, a, b, path, mv[o:o + nt], mv[o + nt:o + nt + n1], mv[o + nt + n1:end])


def verify_block(ns: Namespace, raw: bytes | None, *, lookup_hash: int, parent_hash: int, tokens: bytes,
                 extra: int, path: PathDigest, payload_bytes: int) -> memoryview:
    """The bundle record of the block a prompt asks for, from a stored value; raises
    :class:`RecordError` unless the value is exactly that block, whole."""
    r = _parse(ns, raw)
    if r.rtype != TYPE_BLOCK or r.h != lookup_hash & _MASK64:
        raise RecordError(Miss.STALE, "not this block's record")
    if len(r.p1) != payload_bytes or len(r.p2):
        raise RecordError(Miss.DAMAGED, f"payload of {len(r.p1)} B, this engine's blocks have {payload_bytes}")
    if r.a != parent_hash & _MASK64 or r.b != extra & _MASK64 or r.tokens != tokens or r.path != path:
        raise RecordError(Miss.COLLISION, "the tokens, extra key or path differ")
    return r.p1


def verify_snapshot(ns: Namespace, raw: bytes | None, *, anchor_hash: int, anchor_path: PathDigest,
                    frontier: int, tail_tokens: bytes, image_bytes: int, tail_bytes: int) -> SnapshotPayload:
    """The image and tail of the snapshot a prompt asks for, from a stored value; raises
    :class:`RecordError` unless the value is exactly that snapshot, whole."""
    r = _parse(ns, raw)
    if r.rtype != TYPE_SNAPSHOT or r.h != anchor_hash & _MASK64 or r.a != frontier:
        raise RecordError(Miss.STALE, "not this snapshot's record")
    want_tail = tail_bytes if tail_tokens else 0
    if len(r.p1) != image_bytes or len(r.p2) != want_tail or r.kind >= len(KINDS):
        raise RecordError(Miss.DAMAGED, f"image {len(r.p1)} B and tail {len(r.p2)} B, this engine's are "
                                        f"{image_bytes} and {want_tail}")
    if r.tokens != tail_tokens or r.path != anchor_path:
        raise RecordError(Miss.COLLISION, "the tail tokens or anchor path differ")
    return SnapshotPayload(KINDS[r.kind], int(r.b), r.p1, r.p2)


def record_bytes(tokens: int, payloads: Sequence[int]) -> int:
    """Bytes of a stored value with ``tokens`` packed tokens and these payloads."""
    return HEADER_BYTES + 4 * tokens + sum(payloads) + _U64.size
