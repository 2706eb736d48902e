"""Block keys and exact identity (spec §5.1).

Block ``b`` of a prompt covers absolute positions ``[64b, 64b+64)``. Its identity is
``BlockKey(parent, tokens[64b:64b+64], extra)``; ``extra`` is the media key of the Vision
items that reach the block (0 when none overlaps it).

``lookup_hash`` chains xxh3_64 over the parent's hash, the block's tokens and its extra key::

    lookup_hash(-1) = HASH_SEED
    lookup_hash(b)  = xxh3_64(le64(lookup_hash(b-1)) || le32(tokens[64b..64b+63]) || le64(extra))

xxh3_64 runs with its default seed 0; the chain's starting value is :data:`HASH_SEED`. Tokens
are packed as little-endian int32 on every machine, so hashes are stable across hosts (the
persistence file relies on that). A hash only selects a child in the parent's child map:
tokens and extra are always compared exactly (spec §5.1, §10.5).

A request's ``cache_salt`` (a tenant's secret, docs/security.md) is mixed into the extra key of
every block of its prompt (:func:`salted_extra`), so it enters the hash chain and the exact
comparison: prompts with different salts (or one salted, one not) share no block, and so no
snapshot anchored on one. A salted prompt also never uses or leaves a snapshot anchored at the
root (a frontier inside the first block), which has no block to carry the salt.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import xxhash

BLOCK_TOKENS = 64
#: ``lookup_hash(-1)``: the chain's starting value. ASCII "HPC-BLK1" read as a little-endian u64.
HASH_SEED = int.from_bytes(b"HPC-BLK1", "little")

_MASK64 = (1 << 64) - 1
_xxh = xxhash.xxh3_64_intdigest


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Pack token ids as little-endian int32 (4 bytes a token): the exact form nodes store."""
    arr = array("i", tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def lookup_hash(parent_hash: int, block_tokens: bytes, extra: int = 0) -> int:
    """One step of the chain: ``xxh3_64(le64(parent_hash) || tokens || le64(extra))``."""
    return _xxh(parent_hash.to_bytes(8, "little") + block_tokens + (extra & _MASK64).to_bytes(8, "little"))


@dataclass(slots=True, frozen=True)
class BlockKey:
    """Exact identity of a block: its parent node, its 64 tokens (packed) and its extra key."""

    parent: int  # NodeId of the parent (the root is 0)
    tokens: bytes
    extra: int = 0


@dataclass(slots=True, frozen=True)
class MediaItem:
    """One Vision item of a prompt: what ``media_key`` hashes (spec §5.1)."""

    content_digest: bytes  # 32 bytes (e.g. sha256 of the pixels)
    modality: int
    grid: tuple[int, ...]
    begin: int  # first token of the item's placeholder span
    length: int  # number of placeholder tokens

    @property
    def end(self) -> int:
        return self.begin + self.length


def media_key(block: int, items: Sequence[MediaItem]) -> int:
    """``media_key(b)``: 0 when no item overlaps block ``b``; otherwise xxh3_64 over every item
    that overlaps the block or begins before it (earlier items shift later MRoPE positions)."""
    lo, hi = block * BLOCK_TOKENS, block * BLOCK_TOKENS + BLOCK_TOKENS
    if not any(it.begin < hi and it.end > lo for it in items):
        return 0
    h = xxhash.xxh3_64()
    for it in sorted(items, key=lambda i: i.begin):
        if it.begin >= hi:
            break
        if len(it.content_digest) != 32:
            raise ValueError("media content_digest must be 32 bytes")
        _hash_item(h, it)
    return h.intdigest() or 1  # 0 is reserved for "no Vision item"


def tail_media_key(begin: int, end: int, items: Sequence[MediaItem]) -> int:
    """The media key of a snapshot tail ``[begin, end)`` (a frontier inside a block): 0 when no
    item overlaps it; otherwise xxh3_64 over the overlapping items, as :func:`media_key` hashes
    them. Items wholly before the tail are covered by the anchor's blocks already."""
    h = None
    for it in sorted(items, key=lambda i: i.begin):
        if it.begin >= end:
            break
        if it.end <= begin:
            continue
        if h is None:
            h = xxhash.xxh3_64(b"HPC-TAIL")
        _hash_item(h, it)
    return 0 if h is None else (h.intdigest() or 1)


def _hash_item(h: "xxhash.xxh3_64", it: MediaItem) -> None:
    """One item into a media key: its content digest, modality, grid and placeholder span."""
    h.update(it.content_digest)
    h.update(it.modality.to_bytes(4, "little"))
    for g in it.grid:
        h.update(int(g).to_bytes(8, "little"))
    h.update(it.begin.to_bytes(8, "little"))
    h.update(it.length.to_bytes(8, "little"))


def salt_key(salt: str) -> int:
    """The 64-bit key of a cache salt (never 0)."""
    return _xxh(b"HPC-SALT" + salt.encode("utf-8", "surrogatepass")) or 1


def salted_extra(extra: int, key: int) -> int:
    """A block's extra key under a salt key: xxh3_64 of both (never 0, so never "no extra")."""
    return _xxh((extra & _MASK64).to_bytes(8, "little") + key.to_bytes(8, "little")) or 1


def media_extras(n_blocks: int, items: Sequence[MediaItem]) -> list[int]:
    """The extra key of every full block of a prompt."""
    if not items:
        return [0] * n_blocks
    return [media_key(b, items) for b in range(n_blocks)]


def block_hashes(tokens: Sequence[int] | bytes, extras: Sequence[int] | None = None,
                 seed: int = HASH_SEED) -> list[int]:
    """``lookup_hash`` of every full block of a prompt, in one call (spec §5.1: the Frontend
    computes them during preparation, off the worker). ``tokens`` may be already packed."""
    tb = tokens if isinstance(tokens, (bytes, bytearray)) else token_bytes(tokens)
    n_blocks = len(tb) // (4 * BLOCK_TOKENS)
    out = [0] * n_blocks
    h = seed
    step = 4 * BLOCK_TOKENS
    zero = b"\0" * 8
    xxh = _xxh
    if extras is None:
        for b in range(n_blocks):
            h = xxh(h.to_bytes(8, "little") + tb[b * step:(b + 1) * step] + zero)
            out[b] = h
    else:
        for b in range(n_blocks):
            e = extras[b]
            h = xxh(h.to_bytes(8, "little") + tb[b * step:(b + 1) * step] + (e & _MASK64).to_bytes(8, "little"))
            out[b] = h
    return out


@dataclass(slots=True)
class PreparedPrompt:
    """What the index needs of a prompt: built once by :func:`prepare_prompt` (off the worker).

    ``blocks[b]`` is the packed tokens of full block ``b``; ``hashes`` and ``extras`` are per full
    block; ``vision_spans`` are ``(begin, length)`` of Vision placeholder spans.
    """

    tokens: bytes = field(repr=False)  # the whole prompt, packed little-endian int32
    n: int
    blocks: list[bytes] = field(repr=False)
    hashes: list[int] = field(repr=False)
    extras: list[int] = field(repr=False)
    vision_spans: tuple[tuple[int, int], ...] = ()
    media: tuple[MediaItem, ...] = field(default=())
    salt: int = 0  # salt_key of the request's cache_salt, 0 when it has none

    def tail_tokens(self, begin: int, end: int) -> bytes:
        """Packed tokens ``[begin, end)`` (a snapshot tail)."""
        return self.tokens[4 * begin:4 * end]

    def inside_vision(self, frontier: int) -> bool:
        """True when ``frontier`` lies strictly inside a Vision span (not a valid resume point)."""
        return any(b < frontier < b + ln for b, ln in self.vision_spans)

    def tail_extra(self, begin: int, end: int) -> int:
        """The media key of tokens ``[begin, end)`` as a snapshot tail (:func:`tail_media_key`)."""
        return tail_media_key(begin, end, self.media) if self.media else 0

    def block_extra(self, b: int) -> int:
        """The extra key of block ``b``, also past the prompt's full blocks (a block that ends in
        generated tokens): the prompt's media overlapping it (salted as the prompt's blocks are),
        or 0 when none does; under a salt every block's key is salted, as the next turn's prompt
        will key the same tokens."""
        if b < len(self.extras):
            return self.extras[b]
        key = media_key(b, self.media) if self.media else 0
        return salted_extra(key, self.salt) if self.salt else key

    def block_media(self, b: int) -> tuple[MediaItem, ...]:
        """The media items whose tokens block ``b`` holds."""
        lo, hi = b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS
        return tuple(it for it in self.media if it.begin < hi and it.end > lo)


def prepare_prompt(tokens: Sequence[int], media: Iterable[MediaItem] = (), *,
                   hashes: Sequence[int] | None = None, seed: int = HASH_SEED,
                   cache_salt: str | None = None) -> PreparedPrompt:
    """Pack tokens, split full blocks, compute extras (salted by ``cache_salt``) and (unless
    given) the chained hashes."""
    tb = token_bytes(tokens)
    n = len(tb) // 4
    nb = n // BLOCK_TOKENS
    step = 4 * BLOCK_TOKENS
    items = tuple(sorted(media, key=lambda i: i.begin))
    extras = media_extras(nb, items)
    salt = salt_key(cache_salt) if cache_salt is not None else 0
    if salt:
        extras = [salted_extra(e, salt) for e in extras]
    blocks = [tb[b * step:(b + 1) * step] for b in range(nb)]
    hs = list(hashes) if hashes is not None else block_hashes(tb, extras if (items or salt) else None, seed)
    if len(hs) != nb:
        raise ValueError(f"expected {nb} block hashes, got {len(hs)}")
    return PreparedPrompt(tb, n, blocks, hs, extras, tuple((i.begin, i.length) for i in items), items, salt)
