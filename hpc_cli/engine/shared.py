"""The shared cache tier (L3) of one engine: write-behind to a shared store and lookups before
admission (docs/shared-cache.md; keys and records in :mod:`hpc_cli.cache.shared`).

    tier = attach_shared_cache(engine, "redis://127.0.0.1:6379/0")   # before engine.start()

Writes: every block and snapshot whose write-through to the host tier lands
(:meth:`SharedTier.written`, called by the binding's ``poll``) is handed once (by key) to a writer
thread through a queue bounded in bytes, as the host slabs that hold it and their generations;
the thread copies the bytes out of the slabs (dropping the entry if a slab was freed meanwhile:
its bytes may be another owner's), encodes, checksums and stores it (``SET NX``; a snapshot also joins its anchor's set), so
other replicas can use it at once. A full queue or a store that is down drops the entry (the
host tier still has it).

Lookups: when an admission's own tiers leave at least a block of the prompt to prefill
(:meth:`SharedTier.before_admit`), a lookup thread reads the anchor sets of the prompt's blocks
(one round trip), picks the deepest snapshot whose tail matches the prompt and reads it with the
path blocks the index lacks (a second round trip). Every value is checked against the prompt
(namespace, size, checksum, tokens, path digest); for what passes the worker reserves host slabs,
the lookup thread copies the bytes into them (the worker copies nothing), and the worker adopts
them host-only once copied (or gives them back if the prompt's path changed meanwhile); the
ordinary quote and restore then bring it to the device. The head
waits (``Blocked``) for at most ``timeout_s``; a miss, a damaged value, a timeout or a store that
is down is a prefill from the engine's own tiers, never a failed request. After a store failure
the tier stops asking for a while (0.5 s, doubling to 10 s) and logs one warning per outage.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from hpc_cli import plugins
from hpc_cli.cache import shared as rec
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, PreparedPrompt
from hpc_cli.cache.shared import (BlockEntry, Miss, Namespace, PathDigest, RecordError, SnapshotEntry,
                                  SnapshotPayload, StoreKey)
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.tree import RESIDENT, BlockNode
from hpc_cli.engine.binding import Blocked
from hpc_cli.errors import ConfigError
from hpc_cli.shared_store import SharedStore, SharedStoreUnavailable

if TYPE_CHECKING:
    from hpc_cli.cache.records import WriteBatch
    from hpc_cli.engine.engine import Engine
    from hpc_cli.engine.hybrid import HybridBinding
    from hpc_cli.engine.lane import Lane

log = logging.getLogger("hpc_cli.engine.shared")

#: anchors whose sets one lookup reads at most (the deepest; 4096 blocks = 256k tokens)
MAX_ANCHORS = 4096
#: snapshots one lookup tries, deepest first, before it gives up
MAX_CANDIDATES = 4
#: keys this engine remembers having stored or found stored (not sent again)
SEEN_KEYS = 1 << 16
#: a lookup runs on the worker itself (no thread hand-off, no wait for the next step) while what
#: it reads stays below this many bytes; larger hits go to the lookup thread while the head waits
SYNC_FETCH_BYTES = 32 << 20
#: the worker's own store calls give up after at most this long (the lookup thread's after timeout_s)
SYNC_TIMEOUT_S = 0.25
#: entries and bytes the writer sends in one pipeline
WRITE_GROUP_ITEMS, WRITE_GROUP_BYTES = 64, 64 << 20


@dataclass(frozen=True, slots=True)
class SharedTierConfig:
    url: str
    timeout_s: float = 2.0  # each store call's limit, and how long an admission waits for its lookup
    queue_bytes: int = 256 << 20  # entries copied out and not yet stored


class Health:
    """Whether the store answers: after a failure the tier stops asking until ``retry_at``
    (0.5 s, doubling to 10 s while failures go on); one warning per outage, one line when it
    answers again. Shared by the writer and lookup threads and read by the worker."""

    FIRST_S, MAX_S = 0.5, 10.0

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self.down = False
        self.retry_at = 0.0
        self.backoff = self.FIRST_S
        self.outages = 0
        self.last_error: str | None = None

    def available(self) -> bool:
        return not self.down or time.monotonic() >= self.retry_at

    def ok(self) -> None:
        if not self.down:
            return
        with self._lock:
            if self.down:
                self.down = False
                self.backoff = self.FIRST_S
                log.warning("shared cache %s is reachable again", self.where)

    def failed(self, exc: Exception) -> None:
        with self._lock:
            self.last_error = str(exc)
            first = not self.down
            self.down = True
            self.retry_at = time.monotonic() + self.backoff
            if first:
                self.outages += 1
                log.warning("shared cache %s unavailable (%s); serving from the device and host tiers, "
                            "retrying from %.1f s on", self.where, exc, self.backoff)
            self.backoff = min(2 * self.backoff, self.MAX_S)


class _Defer(Exception):
    """A lookup on the worker found more bytes to read than SYNC_FETCH_BYTES: hand it over."""


@dataclass(frozen=True, slots=True)
class _SlabRead:
    """Bytes of one host slab that an entry's value takes, read on the writer thread: valid only
    while the slab's generation (times freed) is still ``generation``."""

    slab: int
    generation: int
    nbytes: int
    part: str  # "payload" (a block), "image" or "tail" (a snapshot)


@dataclass(slots=True)
class _Write:
    key: StoreKey
    entry: BlockEntry | SnapshotEntry  # its payload, image and tail read from ``reads`` when stored
    nbytes: int
    reads: tuple[_SlabRead, ...] = ()


@dataclass(slots=True)
class Hit:
    """What a lookup found: the snapshot at ``frontier`` anchored on prompt block ``anchor`` and
    the payloads of the path blocks the index lacked when the lookup started (by block index)."""

    frontier: int
    anchor: int
    snapshot: SnapshotPayload
    tail_tokens: bytes
    blocks: dict[int, memoryview]
    nbytes: int


@dataclass(slots=True, eq=False)
class _Lookup:
    lane: "Lane"
    prompt: PreparedPrompt
    local_frontier: int  # the deepest snapshot the index had for the prompt
    local_blocks: int  # its matched path
    max_slabs: int  # the host tier's size: a candidate that needs more is skipped
    started: float
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    hit: Hit | None = None
    miss: str | None = None  # why nothing came back


@dataclass(slots=True, eq=False)
class _Landing:
    """A hit being copied into host slabs reserved for it, on the lookup thread: the worker
    reserved the slabs with the prompt's path at ``path_len`` blocks and adopts them once the
    copy is done (or gives them back if the path changed meanwhile, or the lane left)."""

    lane: "Lane"
    hit: Hit
    path_len: int
    new: list[int]  # the prompt's block indices adopted as new host-only nodes
    block_slabs: list[int]
    image_slabs: list[int]
    tail_slab: int
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    @property
    def slabs(self) -> list[int]:
        return [*self.block_slabs, *self.image_slabs, *([self.tail_slab] if self.tail_slab >= 0 else [])]


class SharedTier:
    """One engine's view of the shared store (see the module doc). The worker calls
    :meth:`before_admit`, :meth:`start_lookup`, :meth:`written` and :meth:`stats`; the rest runs on
    the tier's two threads."""

    def __init__(self, cache: "HybridBinding", store: SharedStore, ns: Namespace, config: SharedTierConfig,
                 where: str, wake: Callable[[], None] = lambda: None, probe_store: SharedStore | None = None) -> None:
        self.cache = cache
        self.store = store  # the writer's and the lookup thread's
        self.probe_store = probe_store or store  # the worker's (a shorter timeout)
        self.ns = ns
        self.config = config
        self.where = where
        self.wake = wake
        self.health = Health(where)
        index = cache.index
        self.block_bytes = index.block_bytes
        self.image_bytes = index.image_bytes
        self.slab_bytes = cache.host.slab_bytes
        self.image_slabs = index.image_slabs
        self._lookup: _Lookup | None = None
        self._landing: _Landing | None = None  # the head's hit being copied in
        self._abandoned: list[_Landing] = []  # copies of lanes that left: slabs given back once done
        self._looked_up: "Lane | None" = None  # the lane whose lookup ended (adopted or missed)
        self._digests: dict[BlockNode, PathDigest] = {}
        self._seen: collections.OrderedDict[StoreKey, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.misses: collections.Counter[str] = collections.Counter()
        self.lookup_seconds = 0.0
        self._queued_bytes = 0
        self._writes: "queue.Queue[_Write | None]" = queue.Queue()
        self._jobs: "queue.Queue[_Lookup | _Landing | None]" = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="hpc-shared-writer", daemon=True)
        self._fetcher = threading.Thread(target=self._lookup_loop, name="hpc-shared-lookup", daemon=True)
        self._writer.start()
        self._fetcher.start()

    def describe(self) -> str:
        return f"shared cache tier {self.where} (namespace {self.ns})"

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # ------------------------------------------------------------------ lookups (worker side)
    def _plan(self, lane: "Lane") -> _Lookup | None:
        """The lookup ``lane`` needs, or None (and the lane counts as looked up): nothing resumes
        (prompt logprobs, cache disabled), the own tiers leave less than a block to gain, or the
        store is down."""
        if self._lookup is not None:  # the head changed (cancelled): forget its lookup
            self._count("lookups_abandoned")
            self._lookup = None
        req = lane.request
        prompt = lane.prepared
        if self._closed or not req.cache_enabled or req.sampling.prompt_logprobs:
            self._looked_up = lane
            return None
        index = self.cache.index
        m = index.match(prompt)
        local = max((s.frontier for s in m.candidates), default=0)
        if prompt.n - 1 - local < BLOCK_TOKENS:
            self._looked_up = lane
            return None
        if not self.health.available():
            self._count("lookups_skipped_down")
            self._looked_up = lane
            return None
        now = time.monotonic()
        self._count("lookups")
        return _Lookup(lane, prompt, local, len(m.path), index.host.ready_slabs, now, now + self.config.timeout_s)

    def start_lookup(self, lane: "Lane") -> None:
        """Begin ``lane``'s lookup on the lookup thread (the FIFO head waits for a lane or for
        pages: the lookup runs meanwhile). Never blocks."""
        self._reap(lane)
        if self._looked_up is lane or (self._lookup is not None and self._lookup.lane is lane) or (
                self._landing is not None and self._landing.lane is lane):
            return
        job = self._plan(lane)
        if job is not None:
            self._submit(job)

    def _submit(self, job: _Lookup) -> None:
        self._lookup = job
        self._count("lookups_async")
        self._jobs.put(job)

    def before_admit(self, lane: "Lane") -> None:
        """Called by admission before its quote: look up what ``lane``'s prompt lacks and adopt a
        hit host-only. Small lookups run here at once (bounded by SYNC_TIMEOUT_S); a large hit
        goes to the lookup thread and the head waits (:class:`Blocked`, at most ``timeout_s``)."""
        self._reap(lane)
        if self._looked_up is lane:
            return
        landing = self._landing
        if landing is not None:  # the head's hit is being copied in (it is the head: _reap)
            if not landing.done.is_set():
                raise Blocked("copying a shared cache hit into the host tier")
            self._landing = None
            self._land(landing)
            self._end(lane)
            return
        job = self._lookup
        if job is None or job.lane is not lane:
            job = self._plan(lane)
            if job is None:
                return
            try:
                job.hit, job.miss = self._find(job, self.probe_store, sync=True)
                self.health.ok()
            except _Defer:
                self._submit(job)
                raise Blocked("waiting for the shared cache tier") from None
            except SharedStoreUnavailable as exc:
                self.health.failed(exc)
                job.miss = "unavailable"
            except Exception:  # noqa: BLE001 - a lookup must never fail a request
                log.exception("shared cache lookup failed")
                job.miss = "error"
            job.done.set()
        elif not job.done.is_set():
            if time.monotonic() < job.deadline:
                raise Blocked("waiting for the shared cache tier")
            self.misses["timeout"] += 1
            self._end(lane)
            return
        self.lookup_seconds += time.monotonic() - job.started
        if job.hit is None:
            self.misses[job.miss or "none"] += 1
            self._end(lane)
            return
        landing = self._reserve(lane, job.hit)
        if landing is None:
            self._end(lane)
            return
        self._lookup = None
        self._landing = landing
        self._jobs.put(landing)  # the bytes are copied on the lookup thread, not here
        raise Blocked("copying a shared cache hit into the host tier")

    def _reap(self, head: "Lane | None") -> None:
        """Give back the slabs of copies whose lane is no longer the head, once each is done
        (the thread may still be writing into them before)."""
        landing = self._landing
        if landing is not None and landing.lane is not head:
            self._landing = None
            self._abandoned.append(landing)
            self._count("landings_abandoned")
        if self._abandoned:
            index = self.cache.index
            for landing in [x for x in self._abandoned if x.done.is_set()]:
                self._abandoned.remove(landing)
                index.release_host_slabs(landing.slabs)

    def _end(self, lane: "Lane") -> None:
        self._lookup = None
        self._looked_up = lane

    def _reserve(self, lane: "Lane", hit: Hit) -> _Landing | None:
        """Reserve host slabs for a hit under the prompt's path as the index has it now (other
        lanes may have committed or evicted blocks meanwhile), or None (counted as a miss)."""
        index = self.cache.index
        path = index.match(lane.prepared).path
        a = hit.anchor
        if _holds(path, hit):
            self.misses["already_local"] += 1
            return None
        new = list(range(len(path), a + 1))
        if any(b not in hit.blocks for b in new):
            self.misses["path_changed"] += 1
            return None
        tail = bool(hit.tail_tokens)
        need = len(new) + self.image_slabs + (1 if tail else 0)
        slabs, freed = index.reserve_host_slabs(need, keep=path)
        self.cache._free_pages(freed.pages)
        if slabs is None:
            self.misses["host_tier_full"] += 1
            return None
        return _Landing(lane, hit, len(path), new, slabs[:len(new)], slabs[len(new):len(new) + self.image_slabs],
                        slabs[-1] if tail else -1)

    def _copy(self, landing: _Landing) -> None:
        """Copy a hit's bytes into its reserved slabs (the lookup thread; nothing else touches
        reserved slabs)."""
        host, hit, sb = self.cache.host, landing.hit, self.slab_bytes
        for b, s in zip(landing.new, landing.block_slabs):
            _copy_in(host.slab_view(s).numpy(), hit.blocks[b])
        image = hit.snapshot.image
        for i, s in enumerate(landing.image_slabs):
            _copy_in(host.slab_view(s).numpy(), image[i * sb:(i + 1) * sb])
        if landing.tail_slab >= 0:
            _copy_in(host.slab_view(landing.tail_slab).numpy(), hit.snapshot.tail)

    def _land(self, landing: _Landing) -> None:
        """Adopt a copied hit host-only, if the prompt's path is still the one its slabs were
        reserved under; else give the slabs back. The ordinary quote and restore follow."""
        index = self.cache.index
        prompt = landing.lane.prepared
        hit = landing.hit
        path = index.match(prompt).path
        why = ("copy_failed" if landing.error is not None else "path_changed" if len(path) != landing.path_len
               else "already_local" if _holds(path, hit) else None)
        if why is not None:
            self.misses[why] += 1
            index.release_host_slabs(landing.slabs)
            return
        parent = path[-1] if path else index.tree.root
        for b, s in zip(landing.new, landing.block_slabs):
            parent = index.adopt_host_node(parent, prompt.blocks[b], prompt.extras[b], s, h=prompt.hashes[b],
                                           media=prompt.block_media(b))
        anchor = parent if landing.new else path[hit.anchor]
        index.adopt_host_snapshot(anchor, hit.frontier, hit.snapshot.kind, tail_tokens=hit.tail_tokens,
                                  image_slabs=tuple(landing.image_slabs), tail_slab=landing.tail_slab)
        self.counts["hits"] += 1
        self.counts["hit_tokens"] += hit.frontier
        self.counts["adopted_blocks"] += len(landing.new)
        self.counts["adopted_snapshots"] += 1
        self.counts["fetched_bytes"] += hit.nbytes

    # ------------------------------------------------------------------ lookups (thread side)
    def _lookup_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Landing):
                try:
                    self._copy(job)
                except Exception as exc:  # noqa: BLE001 - a copy must never take the engine down
                    log.exception("copying a shared cache hit failed")
                    job.error = f"{type(exc).__name__}: {exc}"
                job.done.set()
                self.wake()
                continue
            if time.monotonic() >= job.deadline:
                job.miss = "timeout"
            elif not self.health.available():
                job.miss = "unavailable"
            else:
                try:
                    job.hit, job.miss = self._find(job, self.store)
                    self.health.ok()
                except SharedStoreUnavailable as exc:
                    self.health.failed(exc)
                    job.miss = "unavailable"
                except Exception:  # noqa: BLE001 - a lookup must never take the engine down
                    log.exception("shared cache lookup failed")
                    job.miss = "error"
            job.done.set()
            self.wake()

    def _find(self, job: _Lookup, store: SharedStore, sync: bool = False) -> tuple[Hit | None, str | None]:
        """The deepest usable snapshot for the job's prompt, with the path blocks it lacks;
        ``sync`` (on the worker) raises :class:`_Defer` before reading more than SYNC_FETCH_BYTES."""
        p, ns = job.prompt, self.ns
        n = p.n
        a_hi = (n - 1) // BLOCK_TOKENS - 1  # F <= n-1, anchor = F//64 - 1
        a_lo = max(0, job.local_frontier // BLOCK_TOKENS - 1, a_hi - MAX_ANCHORS + 1)
        if a_hi < a_lo:
            return None, "nothing_deeper"
        anchors = list(range(a_lo, a_hi + 1))
        sets = store.members([rec.anchor_key(ns, p.hashes[a]) for a in anchors])
        cands: list[tuple[int, int, int, bytes]] = []
        for a, members in zip(anchors, sets):
            base = BLOCK_TOKENS * (a + 1)
            for member in members:
                parsed = rec.parse_member(member)
                if parsed is None:
                    continue
                f, t = parsed
                if not (base <= f < base + BLOCK_TOKENS and job.local_frontier < f <= n - 1):
                    continue
                if p.media and (p.inside_vision(f) or p.tail_extra(base, f)):
                    continue  # never a resume point inside an image; tails with images are not stored
                if rec.tail_digest(p.tail_tokens(base, f)) != t:
                    continue
                cands.append((f, a, t, member))
        if not cands:
            return None, "no_entry"
        cands.sort(reverse=True)
        digests = rec.path_digests(p, max(c[1] for c in cands) + 1)
        k = job.local_blocks
        fetched: dict[int, memoryview] = {}
        bad_from = n  # the first block index found missing or damaged
        why = "no_entry"
        for f, a, t, member in cands[:MAX_CANDIDATES]:
            if a >= bad_from:
                continue
            if time.monotonic() >= job.deadline:
                return None, "timeout"
            tail_len = f - BLOCK_TOKENS * (a + 1)
            if max(0, a + 1 - k) + self.image_slabs + (1 if tail_len else 0) > job.max_slabs:
                why = "larger_than_host_tier"
                continue
            need = [b for b in range(k, a + 1) if b not in fetched]
            if sync and len(need) * self.block_bytes + self.image_bytes + self.block_bytes > SYNC_FETCH_BYTES:
                raise _Defer()
            skey = rec.snapshot_key(ns, p.hashes[a], f, t)
            values = store.get([skey] + [rec.block_key(ns, p.hashes[b]) for b in need])
            for b, raw in zip(need, values[1:]):
                try:
                    fetched[b] = rec.verify_block(ns, raw, lookup_hash=p.hashes[b],
                                                  parent_hash=p.hashes[b - 1] if b else HASH_SEED,
                                                  tokens=p.blocks[b], extra=p.extras[b], path=digests[b],
                                                  payload_bytes=self.block_bytes)
                except RecordError as exc:
                    self._bad(exc)
                    why = f"block_{exc.miss.value}"
                    bad_from = min(bad_from, b)
                    break
            if a >= bad_from:
                continue
            tail_tokens = p.tail_tokens(BLOCK_TOKENS * (a + 1), f)
            try:
                snap = rec.verify_snapshot(ns, values[0], anchor_hash=p.hashes[a], anchor_path=digests[a],
                                           frontier=f, tail_tokens=tail_tokens, image_bytes=self.image_bytes,
                                           tail_bytes=self.block_bytes)
            except RecordError as exc:
                self._bad(exc)
                why = f"snapshot_{exc.miss.value}"
                if exc.miss is Miss.MISSING:  # evicted from the store: drop it from the anchor's set
                    store.remove_members(rec.anchor_key(ns, p.hashes[a]), [member])
                continue
            blocks = {b: fetched[b] for b in range(k, a + 1)}
            nbytes = len(values[0] or b"") + sum(len(v) for v in blocks.values())
            return Hit(f, a, snap, tail_tokens, blocks, nbytes), None
        return None, why

    def _bad(self, exc: RecordError) -> None:
        if exc.miss is not Miss.MISSING:
            self._count(f"values_{exc.miss.value}")
            log.warning("shared cache %s: a %s value was not used (%s)", self.where, exc.miss.value, exc)

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
            reads = (_SlabRead(bt.slab, pool.generation(bt.slab), self.block_bytes, "payload"),)
            self._enqueue(key, entry, self.block_bytes, reads)
        for st in batch.snapshots:
            s = st.snapshot
            if not self._shareable(s):
                continue
            key = rec.snapshot_key(self.ns, s.anchor.hash, s.frontier, rec.tail_digest(s.tail_tokens))
            if not self._first(key):
                continue
            sb = self.slab_bytes
            reads = [_SlabRead(slab, pool.generation(slab), min(sb, self.image_bytes - i * sb), "image")
                     for i, slab in enumerate(s.host_slabs)]
            if s.tail_tokens:
                reads.append(_SlabRead(s.tail_host_slab, pool.generation(s.tail_host_slab), self.block_bytes, "tail"))
            entry = SnapshotEntry(s.anchor.hash, self._digest(s.anchor), s.frontier, s.kind, s.hits,
                                  s.tail_tokens, b"", b"")
            self._enqueue(key, entry, self.image_bytes + (self.block_bytes if s.tail_tokens else 0), tuple(reads))

    def _read(self, w: _Write) -> BlockEntry | SnapshotEntry | None:
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
                 reads: tuple[_SlabRead, ...] = ()) -> None:
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
        self._writes.put(_Write(key, entry, nbytes, reads))

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

    def _store_group(self, group: list[_Write]) -> None:
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

    # ------------------------------------------------------------------ stats, close
    def stats(self) -> dict[str, object]:
        with self._lock:
            counts = dict(self.counts)
            queued = self._queued_bytes
        return {"where": self.where, "namespace": self.ns, "available": not self.health.down,
                "outages": self.health.outages, "last_error": self.health.last_error,
                "timeout_s": self.config.timeout_s, "queued_bytes": queued,
                "lookups": counts.pop("lookups", 0), "hits": counts.pop("hits", 0),
                "misses": dict(self.misses), "lookup_seconds": round(self.lookup_seconds, 6), **counts}

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued entry was stored (or dropped); True when the queue emptied."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued_bytes == 0 and self._writes.empty():
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 2.0) -> None:
        """Store what is queued (for at most ``timeout`` seconds), stop the threads, close the store."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        self._writes.put(None)
        self._jobs.put(None)
        self._writer.join(timeout)
        self._fetcher.join(timeout)
        if not self._fetcher.is_alive():  # no copy in flight: reserved slabs go back to the pool
            for landing in [*self._abandoned, *([self._landing] if self._landing is not None else [])]:
                self.cache.index.release_host_slabs(landing.slabs)
            self._abandoned, self._landing = [], None
        self.store.close()
        if self.probe_store is not self.store:
            self.probe_store.close()


def _holds(path: list[BlockNode], hit: Hit) -> bool:
    """Whether the prompt's matched ``path`` already has the hit's snapshot."""
    return len(path) > hit.anchor and any(s.frontier == hit.frontier and s.tail_tokens == hit.tail_tokens
                                          for s in path[hit.anchor].snapshots)


def _copy_in(dst: np.ndarray, src: memoryview | bytes) -> None:
    n = len(src)
    dst[:n] = np.frombuffer(src, dtype=np.uint8)


def open_store(url: str, timeout_s: float) -> tuple[SharedStore, str]:
    """The store for ``url`` through the plugin that serves its scheme, and where it is (no
    credentials)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if not u.scheme:
        raise ConfigError(f"cache.shared_cache {url!r} is not a URL",
                          hint="write redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0")
    kind = plugins.shared_store(u.scheme)
    host = u.hostname or ""
    where = f"{u.scheme}://{host}{':' + str(u.port) if u.port else ''}{u.path or ''}"
    return kind.open(url, timeout_s=timeout_s), where


def attach_shared_cache(engine: "Engine", url: str, *, timeout_ms: int = 2000, queue_mib: int = 256) -> SharedTier:
    """Connect ``engine`` to the shared tier at ``url`` (before ``engine.start()``): its namespace
    is the engine's fingerprint and host geometry (spec §5.5). The store need not be up."""
    from hpc_cli.engine.persistence import engine_fingerprint, engine_geometry

    from hpc_cli.engine.hybrid import HybridBinding

    cache = engine.cache
    if not isinstance(cache, HybridBinding) or not cache.reuse:
        raise ConfigError("cache.shared_cache needs cache.mode = 'hybrid' (its blocks and snapshots are what "
                          "replicas share)", hint="set cache.mode = 'hybrid', or leave cache.shared_cache unset")
    if cache.host.num_slabs == 0:
        raise ConfigError("cache.shared_cache needs the host tier (hits restore through it)",
                          hint="set cache.host_cache_mib above 0")
    if cache.shared is not None:
        raise ConfigError("a shared cache tier is already attached", hint="attach one shared cache per engine")
    cfg = SharedTierConfig(url, timeout_ms / 1000.0, queue_mib << 20)
    store, where = open_store(url, cfg.timeout_s)
    ns = rec.namespace(engine_fingerprint(engine), engine_geometry(engine).as_dict())
    probe, _ = open_store(url, min(cfg.timeout_s, SYNC_TIMEOUT_S))
    tier = SharedTier(cache, store, ns, cfg, where, wake=engine._wake.set, probe_store=probe)
    cache.shared = tier
    engine.on_stop.append(lambda _engine: tier.close())
    engine.on_fatal.append(lambda _engine: tier.close(timeout=0.5))
    return tier

