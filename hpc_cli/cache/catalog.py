"""The checkpoint catalog of cache mode ``legacy`` (spec §0 "Legacy mode", §1, §14.1): reuse by
ownership, the baseline the hybrid prefix cache is measured against.

A *checkpoint* is a full recurrent state at a frontier, owned by one :class:`Owner`:

- a **private continuation** (one session's): the token path of its last request and its KV
  pages, with a **session endpoint** checkpoint where that request ended and up to
  ``max_long_anchors_per_continuation`` **long anchors** at multiples of ``long_anchor_spacing``
  (the deepest kept); a request resumed from a continuation's checkpoint replaces it (the
  session moved on), any other request starts a new one; at most ``max_private_continuations``
  are kept (least recently used out);
- a **shared stable prefix**: published when a request shares a block-aligned prefix with
  another session's continuation and nothing already resumes it there (two sessions share it):
  one checkpoint at that frontier over the prefix's pages; at most ``max_shared_prefixes``.

KV is reused only below an owned checkpoint: a request resumes at the deepest checkpoint whose
owner's path is a prefix of its prompt, never at a bare block. This module is pure policy
(owners, matching, limits, recency); :mod:`hpc_cli.engine.legacy` does the device and host work.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator, Sequence

from hpc_cli.cache.keys import BLOCK_TOKENS


class CheckpointKind(enum.Enum):
    SESSION_ENDPOINT = "session_endpoint"
    SHARED_PREFIX = "shared_prefix"
    LONG_ANCHOR = "long_anchor"


class Residency(enum.Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass(eq=False, slots=True)
class Checkpoint:
    """A full state at ``frontier``: in a device state slot, or as an image in host slabs."""

    kind: CheckpointKind
    frontier: int
    slot: int | None = None
    image_slabs: tuple[int, ...] = ()
    hits: int = 0


@dataclass(eq=False, slots=True)
class Owner:
    """A private continuation or a shared stable prefix: its token path, the KV of that path
    (device ``pages`` or host ``slabs``, one per 64-token block, the last one partial) and its
    checkpoints (frontiers on the path, ascending)."""

    id: int
    shared: bool
    salt: int
    tokens: tuple[int, ...]
    checkpoints: list[Checkpoint]
    pages: list[int] = field(default_factory=list)
    slabs: list[int] = field(default_factory=list)
    residency: Residency = Residency.DEVICE
    last_used: int = 0
    readers: int = 0  # lanes restoring from it right now (its host copies must stay)

    @property
    def frontier(self) -> int:
        return len(self.tokens)

    @property
    def blocks(self) -> int:
        return -(-len(self.tokens) // BLOCK_TOKENS)

    @property
    def kind(self) -> str:
        return "shared_prefix" if self.shared else "private_continuation"


@dataclass(frozen=True, slots=True)
class CatalogLimits:
    max_private_continuations: int
    max_shared_prefixes: int
    max_long_anchors_per_continuation: int
    long_anchor_spacing: int


@dataclass(frozen=True, slots=True)
class Match:
    """The deepest owned checkpoint a prompt can resume from (``checkpoint`` None: none), and
    the longest prefix any owner's KV held (reusable or not: reuse-loss attribution)."""

    owner: Owner | None
    checkpoint: Checkpoint | None
    cached_prefix_tokens: int

    @property
    def frontier(self) -> int:
        return self.checkpoint.frontier if self.checkpoint is not None else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences of the same type share."""
    n = min(len(a), len(b))
    i = 0
    while i + BLOCK_TOKENS <= n and a[i:i + BLOCK_TOKENS] == b[i:i + BLOCK_TOKENS]:
        i += BLOCK_TOKENS
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class CheckpointCounts:
    """The checkpoints: all of them, by kind and by their owner's residency (those with none left
    out)."""

    total: int
    by_kind: dict[str, int]
    by_residency: dict[str, int]


@dataclass(frozen=True, slots=True)
class CatalogCounters:
    """The catalog's events since construction (:attr:`CheckpointCatalog.counters`, counted by name)."""

    matches: int
    misses: int
    published_endpoints: int
    published_anchors: int
    published_shared: int
    replaced: int
    evicted: int
    demoted: int


@dataclass(frozen=True, slots=True)
class CatalogStats:
    """The catalog's counts (:meth:`CheckpointCatalog.counts`); its JSON is ``cache.catalog`` of
    cache mode legacy's stats."""

    private_continuations: int
    shared_prefixes: int
    checkpoints: CheckpointCounts
    counters: CatalogCounters


class CheckpointCatalog:
    def __init__(self, limits: CatalogLimits) -> None:
        self.limits = limits
        self.owners: dict[int, Owner] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.counters: dict[str, int] = dict.fromkeys((f.name for f in fields(CatalogCounters)), 0)

    # ------------------------------------------------------------------ lookup
    def match(self, prompt: tuple[int, ...], salt: int, limit: int) -> Match:
        """The deepest checkpoint at a frontier <= ``limit`` whose owner's path is a prefix of
        ``prompt`` (same salt); device copies win a tie."""
        best: tuple[int, int, Owner, Checkpoint] | None = None
        cached = 0
        for owner in self.owners.values():
            if owner.salt != salt:
                continue
            shared = common_prefix(owner.tokens, prompt)
            cached = max(cached, shared)
            for cp in owner.checkpoints:
                if cp.frontier <= min(shared, limit):
                    key = (cp.frontier, owner.residency is Residency.DEVICE)
                    if best is None or key > best[:2]:
                        best = (*key, owner, cp)
        if best is None:
            self.counters["misses"] += 1
            return Match(None, None, min(cached, len(prompt)))
        self.counters["matches"] += 1
        return Match(best[2], best[3], min(cached, len(prompt)))

    def shared_frontier(self, prompt: tuple[int, ...], salt: int, limit: int, resumed: int,
                        source: Owner | None) -> int:
        """The block-aligned frontier (<= ``limit``) of the longest prefix ``prompt`` shares with
        another session's private continuation, when that is deeper than where it resumes;
        0 when there is none (or ``max_shared_prefixes`` is 0)."""
        if self.limits.max_shared_prefixes <= 0:
            return 0
        best = 0
        for owner in self.owners.values():
            if owner.shared or owner is source or owner.salt != salt:
                continue
            n = min(common_prefix(owner.tokens, prompt), limit)
            best = max(best, n - n % BLOCK_TOKENS)
        return best if best > resumed else 0

    def anchor_positions(self, n_prompt: int, start: int) -> list[int]:
        """Long anchors a prefill from ``start`` takes: multiples of the spacing strictly inside
        ``(start, n_prompt)``, the deepest ``max_long_anchors_per_continuation`` of them."""
        g, keep = self.limits.long_anchor_spacing, self.limits.max_long_anchors_per_continuation
        if keep <= 0 or g <= 0:
            return []
        first = (start // g + 1) * g
        return list(range(first, n_prompt, g))[-keep:]

    # ------------------------------------------------------------------ changes
    def new_owner(self, *, shared: bool, salt: int, tokens: Sequence[int], checkpoints: list[Checkpoint],
                  pages: list[int]) -> Owner:
        owner = Owner(next(self._ids), shared, salt, tuple(tokens), sorted(checkpoints, key=lambda c: c.frontier),
                      pages=list(pages), last_used=next(self._clock))
        self.owners[owner.id] = owner
        for cp in owner.checkpoints:
            key = {CheckpointKind.SESSION_ENDPOINT: "published_endpoints", CheckpointKind.LONG_ANCHOR:
                   "published_anchors", CheckpointKind.SHARED_PREFIX: "published_shared"}[cp.kind]
            self.counters[key] += 1
        return owner

    def remove(self, owner: Owner) -> None:
        del self.owners[owner.id]

    def touch(self, owner: Owner) -> None:
        owner.last_used = next(self._clock)

    def trim_anchors(self, checkpoints: list[Checkpoint]) -> tuple[list[Checkpoint], list[Checkpoint]]:
        """Split a continuation's checkpoints into those kept (its endpoint and the deepest
        ``max_long_anchors_per_continuation`` anchors) and those dropped."""
        keep_n = self.limits.max_long_anchors_per_continuation
        anchors = sorted((c for c in checkpoints if c.kind is CheckpointKind.LONG_ANCHOR), key=lambda c: c.frontier)
        dropped = anchors[:max(0, len(anchors) - keep_n)]
        kept = [c for c in checkpoints if c not in dropped]
        return sorted(kept, key=lambda c: c.frontier), dropped

    def over_limit(self) -> list[Owner]:
        """Owners beyond the catalog's slots, least recently used first (readers never)."""
        out: list[Owner] = []
        for shared, cap in ((False, self.limits.max_private_continuations), (True, self.limits.max_shared_prefixes)):
            group = sorted((o for o in self.owners.values() if o.shared is shared), key=lambda o: o.last_used)
            excess = len(group) - max(0, cap)
            out += [o for o in group if o.readers == 0][:max(0, excess)]
        return out

    def lru(self, residency: Residency, exclude: Iterable[Owner] = ()) -> Iterator[Owner]:
        """Owners resident in ``residency`` without readers, least recently used first."""
        skip = {o.id for o in exclude}
        yield from sorted((o for o in self.owners.values()
                           if o.residency is residency and o.readers == 0 and o.id not in skip),
                          key=lambda o: o.last_used)

    # ------------------------------------------------------------------ counts
    def counts(self) -> CatalogStats:
        by_kind: dict[str, int] = {}
        by_res: dict[str, int] = {}
        for o in self.owners.values():
            for cp in o.checkpoints:
                by_kind[cp.kind.value] = by_kind.get(cp.kind.value, 0) + 1
                by_res[o.residency.value] = by_res.get(o.residency.value, 0) + 1
        return CatalogStats(private_continuations=sum(1 for o in self.owners.values() if not o.shared),
                            shared_prefixes=sum(1 for o in self.owners.values() if o.shared),
                            checkpoints=CheckpointCounts(total=sum(by_kind.values()), by_kind=by_kind,
                                                         by_residency=by_res),
                            counters=CatalogCounters(**self.counters))

    def check_invariants(self) -> None:
        for o in self.owners.values():
            fr = [c.frontier for c in o.checkpoints]
            assert fr == sorted(fr) and all(0 < f <= o.frontier for f in fr), f"owner {o.id}: checkpoints {fr}"
            assert o.checkpoints, f"owner {o.id} owns no checkpoint"
            if o.residency is Residency.DEVICE:
                assert len(o.pages) == o.blocks and not o.slabs, f"owner {o.id}: {len(o.pages)} pages, {o.blocks} blocks"
                assert all(c.slot is not None and not c.image_slabs for c in o.checkpoints), f"owner {o.id}: slots"
            else:
                assert len(o.slabs) == o.blocks and not o.pages, f"owner {o.id}: {len(o.slabs)} slabs"
                assert all(c.slot is None and c.image_slabs for c in o.checkpoints), f"owner {o.id}: images"
            assert o.readers >= 0
        assert sum(1 for o in self.owners.values() if not o.shared) <= max(self.limits.max_private_continuations, 0) \
            or any(o.readers for o in self.owners.values()), "private continuations over the limit"
