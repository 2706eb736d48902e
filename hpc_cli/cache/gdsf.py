"""Host valuation: GreedyDual-Size-Frequency (spec §9.3).

    H(s) = L_s + F(s) * C(s) / Z(s)        L_s: the index's L when s was published or last hit
    C(s) = prefill_seconds(base=F_a, tokens=F_s - F_a) - restore_seconds(image), clamped >= 0
           a = nearest retained (not superseded) snapshot above s on its path, or the root (F_a=0)
    Z(s) = image_bytes + tail_bytes + exclusive_path_bytes(s)
           exclusive_path_bytes: host bytes of the path nodes below which s is the only
           retained snapshot
    F(s) = 1 + hits(s)

The index marks a snapshot ``dirty`` when its C or Z may have changed (published, hit,
superseded, retained again, removed, or a host copy of its exclusive path came or went) and
recomputes it before H is read (:class:`Priority`); victim selection then scans the snapshot
table (:func:`min_priority`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from hpc_cli.cache.cost import CacheCostModel
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.tree import ABSENT

if TYPE_CHECKING:
    from hpc_cli.cache.snapshot import Snapshot


def nearest_retained_ancestor(s: Snapshot) -> Snapshot | None:
    a = s.ancestor
    while a is not None and a.superseded:
        a = a.ancestor
    return a


def value_c(s: Snapshot, cost: CacheCostModel, image_bytes: int) -> float:
    """C(s): the prefill a restore of s saves over its nearest retained ancestor, less the
    image's restore time; never negative."""
    a = nearest_retained_ancestor(s)
    fa = a.frontier if a is not None else 0
    c = cost.prefill_seconds(fa, s.frontier - fa) - cost.restore_seconds(image_bytes)
    return c if c > 0.0 else 0.0


def exclusive_path_bytes(s: Snapshot, block_bytes: int) -> int:
    """Host bytes of the nodes on path(s) below which s is the only retained snapshot."""
    if s.superseded:
        return 0
    total = 0
    n = s.anchor
    sid = s.id
    while n.parent is not None and n.retained_below == 1 and n.retained_xor == sid:
        if n.host_state != ABSENT:
            total += block_bytes
        n = n.parent
    return total


def size_z(s: Snapshot, image_bytes: int, block_bytes: int) -> int:
    return image_bytes + (block_bytes if s.tail_tokens else 0) + exclusive_path_bytes(s, block_bytes)


def priority(l_base: float, hits: int, c: float, z: float) -> float:
    """H = L_s + (1 + hits) * C / Z."""
    return l_base + (1 + hits) * c / z


def estimate_priority(L: float, frontier: int, prev_frontier: int, tail: bool,
                      cost: CacheCostModel, image_bytes: int, block_bytes: int) -> float:
    """A new snapshot's estimated H (spec §9.2): no hits, and the blocks since the sequence's
    previous snapshot counted as its own exclusive path."""
    c = cost.prefill_seconds(prev_frontier, frontier - prev_frontier) - cost.restore_seconds(image_bytes)
    c = c if c > 0.0 else 0.0
    own_blocks = max(0, frontier // BLOCK_TOKENS - prev_frontier // BLOCK_TOKENS)
    z = image_bytes + (block_bytes if tail else 0) + own_blocks * block_bytes
    return L + c / z


class Priority:
    """H(s) of the index's snapshots, recomputed only when ``s.dirty``."""

    __slots__ = ("cost", "image_bytes", "block_bytes")

    def __init__(self, cost: CacheCostModel, image_bytes: int, block_bytes: int) -> None:
        self.cost = cost
        self.image_bytes = image_bytes
        self.block_bytes = block_bytes

    def __call__(self, s: Snapshot) -> float:
        if s.dirty:
            s.gdsf_c = value_c(s, self.cost, self.image_bytes)
            s.gdsf_z = size_z(s, self.image_bytes, self.block_bytes)
            s.gdsf_h = priority(s.l_base, s.hits, s.gdsf_c, s.gdsf_z)
            s.dirty = False
        return s.gdsf_h


def min_priority(snapshots: Iterable[Snapshot], h: Priority) -> tuple[Snapshot | None, float]:
    """The retained, unpinned snapshot with a host copy (image or tail) of least H, and its H:
    the victim of §9.3 step 3."""
    victim, best = None, 0.0
    for s in snapshots:
        if s.superseded or s.restore_pins or (s.host_state == ABSENT and s.tail_host_state == ABSENT):
            continue
        v = h(s)
        if victim is None or v < best:
            victim, best = s, v
    return victim, best
