"""Snapshots of the recurrent state (spec §5.3).

A snapshot is the state after tokens ``[0, F)``: anchored on the node of the last full block
below ``F`` (the root when ``F < 64``), with a tail of ``F - 64*(anchor.depth+1)`` tokens
(0..63) whose KV lives in one private page bundle. Its state image lives in a device snapshot
slot and/or in host slabs. A tail holding Vision tokens carries their media key
(``tail_extra``, :func:`hpc_cli.cache.keys.tail_media_key`): placeholder tokens are equal for
different images. There is at most one snapshot per (anchor, tail tokens, tail extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from hpc_cli.cache.ids import PageBundle, SlabId, SnapshotSlot
from hpc_cli.cache.tree import ABSENT, RESIDENT, BlockNode, Residency

if TYPE_CHECKING:
    from hpc_cli.cache.lru import LruEntry, LruList


class SnapshotKind(Enum):
    """Why a snapshot was taken (§7.1, §7.7, §9.3, §12.3)."""

    TAP = "tap"  # a prefill tap (flexible, or exact at a generation opener)
    ENDPOINT = "endpoint"  # request finish or cancel, exact frontier
    OUTPUT_BOUNDARY = "output_boundary"  # a structural boundary in the output (§12.3)
    BOUNDARY = "boundary"  # explicit / structural tap: shared, superseded only on a single chain


@dataclass(slots=True, eq=False)
class Snapshot:
    id: int
    anchor: BlockNode
    frontier: int
    kind: SnapshotKind
    tail_tokens: bytes = b""  # packed; tail_len tokens
    tail_extra: int = 0  # media key of the Vision items the tail holds (0: none)
    # Tail KV (tail_len > 0): one private, immutable page bundle
    tail_pages: PageBundle | None = None
    tail_device_state: Residency = ABSENT
    tail_host_slab: SlabId = SlabId(-1)
    tail_host_state: Residency = ABSENT
    # State image
    device_slot: SnapshotSlot = SnapshotSlot(-1)
    device_state: Residency = ABSENT
    host_slabs: tuple[SlabId, ...] = ()
    host_state: Residency = ABSENT
    restore_pins: int = 0
    superseded: bool = False
    # Host eviction (GDSF, §9.3)
    hits: int = 0
    last_hit_tick: int = 0
    l_base: float = 0.0  # L when published or last hit
    gdsf_h: float = 0.0
    gdsf_c: float = 0.0
    gdsf_z: float = 1.0
    dirty: bool = True  # C and Z must be recomputed before H is read
    ancestor: Snapshot | None = None  # nearest snapshot above on the path
    dependents: dict[Snapshot, None] = field(default_factory=dict)  # those whose ancestor is self
    alive: bool = True
    # device LRU links for the tail page bundle (lru.LruList)
    lru_prev: "LruEntry | None" = None
    lru_next: "LruEntry | None" = None
    lru_list: "LruList | None" = None

    @property
    def tail_len(self) -> int:
        return len(self.tail_tokens) // 4

    @property
    def retained(self) -> bool:
        return not self.superseded

    @property
    def has_tail(self) -> bool:
        return bool(self.tail_tokens)

    @property
    def device_complete(self) -> bool:
        """Image in a device slot and tail (if any) device resident."""
        return self.device_state == RESIDENT and (not self.tail_tokens or self.tail_device_state == RESIDENT)

    def covers(self, other: Snapshot) -> bool:
        """True when ``self`` lies above ``other`` on its path (strictly shallower frontier and a
        prefix of it, tail included)."""
        if self.frontier >= other.frontier:
            return False
        a, b = self.anchor, other.anchor
        if a is b:  # equal media keys: the same items (none beyond self's tail in other's)
            return other.tail_tokens.startswith(self.tail_tokens) and self.tail_extra == other.tail_extra
        if not a.is_ancestor_of(b):
            return False
        if not self.tail_tokens:
            return True
        if self.tail_extra:
            return False  # a tail key does not compare with a block's: never assumed to cover
        # the block after a on other's path must start with self's tail
        n = b
        while n.depth > a.depth + 1:
            n = n.parent
        return n.tokens.startswith(self.tail_tokens)

    def __repr__(self) -> str:
        return (f"Snapshot(id={self.id}, {self.kind.value}, F={self.frontier}, anchor={self.anchor.id}, "
                f"tail={self.tail_len}, slot={self.device_slot}/{self.device_state.name}, "
                f"host={len(self.host_slabs)}/{self.host_state.name}, sup={self.superseded}, "
                f"pins={self.restore_pins})")
