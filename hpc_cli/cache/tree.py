"""Block tree and lookup (spec §5.2, §6.1).

A :class:`BlockNode` is one committed 64-token block: exact tokens (packed, 256 B), its extra
key, its lookup hash, residency per tier (device page bundle, host slab, each Absent, Resident
or Filling) and liveness counts. Children are found by lookup hash; nodes whose hashes collide
under one parent are chained through ``hash_next``, and a hit always compares tokens and extra
exactly, so a hash never decides equality (§5.1, §10.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Iterator

from hpc_cli.cache.ids import PageBundle, SlabId
from hpc_cli.cache.keys import BLOCK_TOKENS, MediaItem, PreparedPrompt

if TYPE_CHECKING:
    from hpc_cli.cache.lru import LruEntry, LruList
    from hpc_cli.cache.snapshot import Snapshot


class Residency(IntEnum):
    """Residency of one copy (device or host) of a node, tail or image."""

    ABSENT = 0
    RESIDENT = 1
    FILLING = 2  # a transfer is writing it; the source is pinned, the destination not mapped


ABSENT, RESIDENT, FILLING = Residency.ABSENT, Residency.RESIDENT, Residency.FILLING


@dataclass(slots=True, eq=False)
class BlockNode:
    """One block of the tree; the root is a node of depth -1 with no tokens."""

    id: int
    parent: BlockNode | None
    depth: int  # block index b: the node covers [64b, 64b+64)
    hash: int
    tokens: bytes
    extra: int = 0
    media: tuple[MediaItem, ...] = ()  # the Vision items whose tokens it holds (what extra keys)
    children: dict[int, BlockNode] = field(default_factory=dict)
    hash_next: BlockNode | None = None  # next sibling with the same lookup hash
    n_children: int = 0
    # Residency
    device_pages: PageBundle | None = None  # one page id per enabled device pool
    device_state: Residency = ABSENT
    host_slab: SlabId = SlabId(-1)
    host_state: Residency = ABSENT
    # Liveness
    active_refs: int = 0  # sequences whose path pins this node
    restore_pins: int = 0  # in-flight transfers reading or writing it
    live_snapshots_below: int = 0  # snapshots whose path includes this node
    retained_below: int = 0  # ... of which retained (not superseded)
    retained_xor: int = 0  # XOR of their ids: the sole one's id when retained_below == 1
    # pin_mass: (1 if this node has restore_pins or a pinned anchored snapshot) + the number of
    # children whose pin_mass > 0. A device-only node with pin_mass > 0 stays out of the LRU:
    # evicting it would delete a subtree a transfer still uses (§6.5), and the arithmetic of
    # §6.3 counts only entries that evicting frees.
    pinned_snaps: int = 0
    self_pin: int = 0
    pin_mass: int = 0
    snapshots: list[Snapshot] = field(default_factory=list)  # anchored here
    alive: bool = True
    # device LRU links (lru.LruList)
    lru_prev: "LruEntry | None" = None
    lru_next: "LruEntry | None" = None
    lru_list: "LruList | None" = None

    @property
    def end(self) -> int:
        """The frontier after this block: 64*(depth+1)."""
        return BLOCK_TOKENS * (self.depth + 1)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def has_device(self) -> bool:
        return self.device_state != ABSENT

    @property
    def has_host(self) -> bool:
        return self.host_state != ABSENT

    @property
    def pinned(self) -> bool:
        return self.active_refs > 0 or self.restore_pins > 0

    def iter_children(self) -> Iterator[BlockNode]:
        for c in self.children.values():
            while c is not None:
                yield c
                c = c.hash_next

    def path(self) -> list[BlockNode]:
        """Nodes from depth 0 down to this one (empty for the root)."""
        out = []
        n = self
        while n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def is_ancestor_of(self, other: BlockNode) -> bool:
        """True when ``self`` is ``other`` or lies on its path."""
        n = other
        d = self.depth
        while n is not None and n.depth > d:
            n = n.parent
        return n is self

    def __repr__(self) -> str:
        return (f"BlockNode(id={self.id}, depth={self.depth}, dev={self.device_state.name}"
                f"{self.device_pages}, host={self.host_state.name}:{self.host_slab}, refs={self.active_refs}, "
                f"pins={self.restore_pins}, live={self.live_snapshots_below})")


@dataclass(slots=True)
class MatchResult:
    """What :meth:`BlockTree.match` finds (spec §6.1).

    ``path`` is the matched nodes ``N_0..N_{k-1}``; ``candidates`` every valid snapshot on it
    (tail equal to the prompt, frontier <= n-1, not inside a Vision span), shallowest first.
    """

    prompt: PreparedPrompt
    path: list[BlockNode]
    candidates: list[Snapshot]

    @property
    def k(self) -> int:
        return len(self.path)

    @property
    def cached_prefix_tokens(self) -> int:
        """Longest cached block prefix, reusable or not (the request log's attribution)."""
        return BLOCK_TOKENS * len(self.path)


class BlockTree:
    """The radix tree of blocks. Structural edits only; the index owns residency and policy."""

    __slots__ = ("root", "_next_id", "size")

    def __init__(self) -> None:
        self.root = BlockNode(0, None, -1, 0, b"", device_state=RESIDENT, host_state=RESIDENT)
        self._next_id = 1
        self.size = 0  # nodes other than the root

    def child(self, parent: BlockNode, h: int, tokens: bytes, extra: int) -> BlockNode | None:
        """The child with exactly these tokens and extra key (the hash only selects)."""
        c = parent.children.get(h)
        while c is not None and (c.tokens != tokens or c.extra != extra):
            c = c.hash_next
        return c

    def insert(self, parent: BlockNode, h: int, tokens: bytes, extra: int) -> BlockNode:
        assert len(tokens) == 4 * BLOCK_TOKENS, f"a block holds 64 tokens, got {len(tokens) // 4}"
        assert self.child(parent, h, tokens, extra) is None, "insert of an existing block key"
        node = BlockNode(self._next_id, parent, parent.depth + 1, h, tokens, extra)
        self._next_id += 1
        node.hash_next = parent.children.get(h)
        parent.children[h] = node
        parent.n_children += 1
        self.size += 1
        return node

    def unlink(self, node: BlockNode) -> None:
        """Remove a childless node from its parent's child map."""
        assert node.n_children == 0, f"unlink of {node!r} which still has children"
        parent = node.parent
        assert parent is not None, "the root is never unlinked"
        c = parent.children.get(node.hash)
        if c is node:
            if node.hash_next is None:
                del parent.children[node.hash]
            else:
                parent.children[node.hash] = node.hash_next
        else:
            while c is not None and c.hash_next is not node:
                c = c.hash_next
            assert c is not None, f"{node!r} missing from its parent's child map"
            c.hash_next = node.hash_next
        node.hash_next = None
        parent.n_children -= 1
        node.alive = False
        self.size -= 1

    def match(self, prompt: PreparedPrompt) -> MatchResult:
        """Walk from the root over blocks ``b < floor((n-1)/64)``: the hash picks the child, tokens
        and extra decide; then collect the valid snapshots on the path (spec §6.1)."""
        n = prompt.n
        limit = (n - 1) // BLOCK_TOKENS if n > 0 else 0
        hashes, blocks, extras = prompt.hashes, prompt.blocks, prompt.extras
        node = self.root
        path: list[BlockNode] = []
        # a salted prompt never resumes from the root's snapshots: no block carries its salt there
        anchored: list[BlockNode] = [node] if node.snapshots and not prompt.salt else []
        append = path.append
        for b in range(limit):
            c = node.children.get(hashes[b])
            if c is None:
                break
            tb = blocks[b]
            ex = extras[b]
            while c.tokens != tb or c.extra != ex:
                c = c.hash_next
                if c is None:
                    break
            else:
                append(c)
                node = c
                if c.snapshots:
                    anchored.append(c)
                continue
            break
        cands: list[Snapshot] = []
        if anchored:
            last = n - 1
            spans = prompt.vision_spans
            tokens = prompt.tokens
            media = bool(prompt.media)
            for a in anchored:
                base = BLOCK_TOKENS * (a.depth + 1)
                for s in sorted(a.snapshots, key=_by_frontier):
                    f = s.frontier
                    if f > last:
                        continue
                    if s.tail_len and tokens[4 * base:4 * f] != s.tail_tokens:
                        continue
                    if s.tail_extra != (prompt.tail_extra(base, f) if media and s.tail_len else 0):
                        continue  # the tail's images differ (placeholder tokens are equal)
                    if spans and any(sb < f < sb + sl for sb, sl in spans):
                        continue  # defensive: taps never land inside a Vision span
                    cands.append(s)
        return MatchResult(prompt, path, cands)

    def walk(self) -> Iterator[BlockNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.iter_children())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.iter_children())


def _by_frontier(s: Snapshot) -> int:
    return s.frontier
