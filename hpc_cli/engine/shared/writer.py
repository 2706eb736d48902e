"""Write-behind of the shared tier: every block and snapshot whose write-through to the host
tier lands is handed once (by key) to the writer thread through a queue bounded in bytes, as the
host slabs that hold it and their generations; the thread copies the bytes out (dropping the
entry if a slab was freed meanwhile: its bytes may be another owner's), encodes, checksums and
stores it (``SET NX``; a snapshot also joins its anchor's set). A full queue or a store that is
down drops the entry (the host tier still has it)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_cli.cache import shared as rec
from hpc_cli.cache.shared import BlockEntry, Namespace, PathDigest, SnapshotEntry, StoreKey
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.tree import RESIDENT, BlockNode
from hpc_cli.engine.shared.health import Health
from hpc_cli.shared_store import SharedStore, SharedStoreUnavailable

if TYPE_CHECKING:
    from hpc_cli.cache.records import WriteBatch
    from hpc_cli.engine.hybrid import HybridBinding
    from hpc_cli.engine.shared.tier import SharedTierConfig

log = logging.getLogger("hpc_cli.engine.shared")

#: keys this engine remembers having stored or found stored (not sent again)
SEEN_KEYS = 1 << 16
WRITE_GROUP_ITEMS, WRITE_GROUP_BYTES = 64, 64 << 20

@dataclass(frozen=True, slots=True)
class SlabRead:
    """Bytes of one host slab that an entry's value takes, read on the writer thread: valid only
    while the slab's generation (times freed) is still ``generation``."""

    slab: int
    generation: int
    nbytes: int
    part: str  # "payload" (a block), "image" or "tail" (a snapshot)


@dataclass(slots=True)
class Write:
    key: StoreKey
    entry: BlockEntry | SnapshotEntry  # its payload, image and tail read from ``reads`` when stored
    nbytes: int
    reads: tuple[SlabRead, ...] = ()



class Writes:
    """The tier's write side (mixed into :class:`~hpc_cli.engine.shared.tier.SharedTier`, which
    sets these attributes up)."""

    cache: "HybridBinding"
    store: SharedStore
    ns: Namespace
    config: "SharedTierConfig"
    health: Health
    block_bytes: int
    image_bytes: int
    slab_bytes: int
    counts: "collections.Counter[str]"
    _lock: threading.Lock
    _closed: bool
    _queued_bytes: int
    _writes: "queue.Queue[Write | None]"
    _digests: dict[BlockNode, PathDigest]
    _seen: "collections.OrderedDict[StoreKey, None]"

    # ------------------------------------------------------------------ writes (worker side)
    def written(self, batch: "WriteBatch") -> None:
        """A write-through to the host tier landed: queue what it wrote for the store, once. The
        worker only notes which slabs hold each value and their generations; the writer thread
        copies them out (:meth:`_read`)."""
        if self._closed:
            return
        pool = self.cache.index.host
        for bt in batch.blocks:
            node = bt.node
            if not node.alive or node.host_state != RESIDENT or node.host_slab != bt.slab:
                continue
            key = rec.block_key(self.ns, node.hash)
            if not self._first(key):
                continue
            entry = BlockEntry(node.hash, node.parent.hash, node.extra, node.tokens, self._digest(node), b"")
            reads = (SlabRead(bt.slab, pool.generation(bt.slab), self.block_bytes, "payload"),)
            self._enqueue(key, entry, self.block_bytes, reads)
        for st in batch.snapshots:
            s = st.snapshot
            if not self._shareable(s):
                continue
            key = rec.snapshot_key(self.ns, s.anchor.hash, s.frontier, rec.tail_digest(s.tail_tokens))
            if not self._first(key):
                continue
            sb = self.slab_bytes
            reads = [SlabRead(slab, pool.generation(slab), min(sb, self.image_bytes - i * sb), "image")
                     for i, slab in enumerate(s.host_slabs)]
            if s.tail_tokens:
                reads.append(SlabRead(s.tail_host_slab, pool.generation(s.tail_host_slab), self.block_bytes, "tail"))
            entry = SnapshotEntry(s.anchor.hash, self._digest(s.anchor), s.frontier, s.kind, s.hits,
                                  s.tail_tokens, b"", b"")
            self._enqueue(key, entry, self.image_bytes + (self.block_bytes if s.tail_tokens else 0), tuple(reads))

    def _read(self, w: Write) -> BlockEntry | SnapshotEntry | None:
        """The entry with its bytes copied out of the host slabs (on the writer thread), or None
        when a slab was freed meanwhile (its bytes may be another owner's: never stored)."""
        if not w.reads:
            return w.entry
        pool, host = self.cache.index.host, self.cache.host
        parts: dict[str, list[bytes]] = {"payload": [], "image": [], "tail": []}
        for r in w.reads:
            if pool.generation(r.slab) != r.generation:
                return None
            parts[r.part].append(bytes(host.slab_view(r.slab).numpy()[:r.nbytes]))
        if any(pool.generation(r.slab) != r.generation for r in w.reads):
            return None
        e = w.entry
        if isinstance(e, BlockEntry):
            return dataclasses.replace(e, payload=b"".join(parts["payload"]))
        return dataclasses.replace(e, image=b"".join(parts["image"]), tail=b"".join(parts["tail"]))

    def _shareable(self, s: Snapshot) -> bool:
        return (s.alive and s.host_state == RESIDENT and not s.anchor.is_root
                and (not s.tail_tokens or s.tail_host_state == RESIDENT)
                and not getattr(s, "tail_extra", 0))

    def _first(self, key: StoreKey) -> bool:
        """True the first time this engine sees ``key`` (among the last SEEN_KEYS)."""
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            return False
        seen[key] = None
        if len(seen) > SEEN_KEYS:
            seen.popitem(last=False)
        return True

    def _forget(self, key: StoreKey) -> None:
        self._seen.pop(key, None)

    def _enqueue(self, key: StoreKey, entry: BlockEntry | SnapshotEntry, nbytes: int,
                 reads: tuple[SlabRead, ...] = ()) -> None:
        if not self.health.available():
            self._count("writes_dropped_down")
            self._forget(key)
            return
        with self._lock:
            if self._queued_bytes + nbytes > self.config.queue_bytes:
                self.counts["writes_dropped_full"] += 1
                full = True
            else:
                self._queued_bytes += nbytes
                self.counts["writes_queued"] += 1
                full = False
        if full:
            self._forget(key)
            return
        self._writes.put(Write(key, entry, nbytes, reads))

    def _digest(self, node: BlockNode) -> PathDigest:
        """The node's path digest, memoized per node (parents are written before children, so
        the chain is usually one step)."""
        memo = self._digests
        d = memo.get(node)
        if d is not None:
            return d
        chain = []
        n = node
        while n.parent is not None and n not in memo:
            chain.append(n)
            n = n.parent
        d = rec.ROOT_PATH if n.parent is None else memo[n]
        for x in reversed(chain):
            d = rec.path_digest(d, x.tokens, x.extra)
            memo[x] = d
        if len(memo) > 4 * (self.cache.host.num_slabs + 1024):
            self._digests = {k: v for k, v in memo.items() if k.alive}
        return d

    # ------------------------------------------------------------------ writes (thread side)
    def _write_loop(self) -> None:
        stop = False
        while not stop:
            item = self._writes.get()
            if item is None:
                return
            group = [item]
            nbytes = item.nbytes
            while len(group) < WRITE_GROUP_ITEMS and nbytes < WRITE_GROUP_BYTES:
                try:
                    more = self._writes.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                group.append(more)
                nbytes += more.nbytes
            try:
                self._store_group(group)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes

    def _store_group(self, group: list[Write]) -> None:
        if not self.health.available():
            self._count("writes_dropped_down", len(group))
            return
        # blocks first, then snapshots, then the anchor sets that make the snapshots findable
        group.sort(key=lambda w: isinstance(w.entry, SnapshotEntry))
        read: list[tuple[StoreKey, BlockEntry | SnapshotEntry]] = []
        for w in group:
            e = self._read(w)
            if e is None:
                self._count("writes_dropped_recycled")
            else:
                read.append((w.key, e))
        items: list[tuple[StoreKey, bytes]] = []
        for key, e in read:
            items.append((key, rec.encode_block(self.ns, e) if isinstance(e, BlockEntry)
                          else rec.encode_snapshot(self.ns, e)))
        try:
            wrote = self.store.put(items)
            anchors: dict[StoreKey, list[bytes]] = {}
            for _, e in read:
                if isinstance(e, SnapshotEntry):
                    anchors.setdefault(rec.anchor_key(self.ns, e.anchor_hash), []).append(
                        rec.anchor_member(e.frontier, e.tail_key))
            for key, members in anchors.items():
                self.store.add_members(key, members)
            self.health.ok()
        except SharedStoreUnavailable as exc:
            self.health.failed(exc)
            self._count("writes_failed", len(group))
            return
        with self._lock:
            self.counts["writes_stored"] += sum(wrote)
            self.counts["writes_present"] += len(wrote) - sum(wrote)
            self.counts["written_bytes"] += sum(len(v) for (_, v), w in zip(items, wrote) if w)

