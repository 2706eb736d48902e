"""Counts and bytes of the index, by kind and residency, as a plain JSON-able dict (for
metrics and the terminal view), and the running event counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_cli.cache.index import PrefixIndex


@dataclass(slots=True)
class Counters:
    """Events since construction (monotonic)."""

    quotes: int = 0
    stages: int = 0
    reuse_tokens: int = 0
    restores: int = 0
    restored_bytes: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0
    commits: Counter = field(default_factory=Counter)
    published: Counter = field(default_factory=Counter)
    publish_duplicates: int = 0
    snapshot_hits: int = 0
    superseded: int = 0
    retained_again: int = 0
    image_writes_refused: int = 0
    block_writes_refused: int = 0
    writes_landed: int = 0
    device_evictions_backed: int = 0
    device_evictions_unbacked: int = 0
    dead_kv_reclaimed: int = 0
    host_superseded_evictions: int = 0
    host_gdsf_evictions: int = 0
    slot_value_evictions: int = 0
    taps_skipped_no_slot: int = 0
    nodes_deleted: int = 0
    snapshots_deleted: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["commits"] = dict(self.commits)
        d["published"] = dict(self.published)
        return d


def _res(dev: bool, host: bool) -> str:
    return "both" if dev and host else "device" if dev else "host" if host else "none"


def stats(index: PrefixIndex) -> dict:
    """A snapshot of the index: node and snapshot counts by residency and kind, host slabs and
    bytes by use, device pages cached, LRU and dead-KV lengths, slots, L and the counters."""
    from hpc_cli.cache.tree import ABSENT, FILLING

    nodes = Counter()
    filling = Counter()
    pinned = 0
    for n in index.tree.walk():
        nodes[_res(n.device_state != ABSENT, n.host_state != ABSENT)] += 1
        if n.device_state == FILLING:
            filling["device"] += 1
        if n.host_state == FILLING:
            filling["host"] += 1
        if n.pinned:
            pinned += 1
    snaps_kind = Counter()
    snaps_res = Counter()
    tails = 0
    superseded = 0
    for s in index.snapshots.values():
        snaps_kind[s.kind.value] += 1
        snaps_res[_res(s.device_state != ABSENT, s.host_state != ABSENT)] += 1
        tails += bool(s.tail_tokens)
        superseded += s.superseded
    host = index.host
    slabs_by_use = Counter()
    if host.enabled:
        for slab in range(host.num_slabs):
            slabs_by_use[host.use_of(slab).name.lower()] += 1
    device_pages = nodes["device"] + nodes["both"] + sum(
        1 for s in index.snapshots.values() if s.tail_pages is not None)
    slots_used = sum(1 for o in index.slot_owner if o is not None)
    sb = host.slab_bytes
    return {
        "nodes": {"total": index.tree.size, **dict(nodes), "filling": dict(filling), "pinned": pinned},
        "snapshots": {"total": len(index.snapshots), "by_kind": dict(snaps_kind),
                      "by_residency": dict(snaps_res), "with_tail": tails, "superseded": superseded},
        "device": {"cached_page_bundles": device_pages, "lru_backed": len(index.lru_backed),
                   "lru_unbacked": len(index.lru_unbacked), "snapshot_slots": len(index.slot_owner),
                   "snapshot_slots_used": slots_used,
                   "block_bytes_cached": device_pages * index.block_bytes,
                   "image_bytes_cached": sum(1 for o in index.slot_owner if o not in (None, "staging"))
                   * index.image_bytes},
        "host": {"slabs": host.num_slabs, "free_slabs": host.free_slabs, "slab_bytes": sb,
                 "slabs_by_use": dict(slabs_by_use),
                 "bytes_by_use": {k: v * sb for k, v in slabs_by_use.items()},
                 "dead_kv_nodes": len(index._dead)},
        "gdsf_L": index.L,
        "epoch": index.epoch,
        "sequences": len(index.sequences),
        "transfers": {"restores": len(index.restores), "writes": len(index.writes)},
        "counters": index.counters.as_dict(),
    }


def snapshot_rows(index: PrefixIndex, limit: int = 16) -> list[dict]:
    """The ``limit`` snapshots of highest GDSF value (then most hits), one JSON-able row each:
    id, frontier, kind, residency of the image and of the tail, hits, GDSF value (``None``
    while stale), superseded. Read-only and bounded; for the terminal view."""
    import heapq

    from hpc_cli.cache.tree import ABSENT

    snaps = list(index.snapshots.values())  # one copy; the walk below never touches the dict
    top = heapq.nlargest(max(0, limit), snaps, key=lambda s: (not s.superseded, s.gdsf_h, s.hits, s.frontier))
    rows = []
    for s in top:
        tail = "-" if not s.tail_tokens else _res(s.tail_device_state != ABSENT, s.tail_host_state != ABSENT)
        rows.append({"id": s.id, "frontier": s.frontier, "kind": s.kind.value,
                     "residency": _res(s.device_state != ABSENT, s.host_state != ABSENT),
                     "tail": tail, "hits": s.hits, "gdsf": None if s.dirty else round(s.gdsf_h, 6),
                     "superseded": s.superseded})
    return rows


def inflight_bytes(index: PrefixIndex) -> dict:
    """Bytes of the restores and write-throughs in flight (block bundles, images, tails)."""
    bb, ib = index.block_bytes, index.image_bytes

    def size(blocks, snaps, image: bool | None) -> int:
        n = len(blocks) * bb
        for t in snaps:  # a write carries an image when it has image slabs
            n += (ib if (image if image is not None else bool(t.slabs)) else 0)
            n += bb if t.tail_pages is not None else 0
        return n

    restores = sum(size(b.blocks, [b.snapshot] if b.snapshot else [], b.restore_image)
                   for b in list(index.restores.values()))
    writes = sum(size(b.blocks, b.snapshots, None) for b in list(index.writes.values()))
    return {"restore_bytes": restores, "write_bytes": writes}
