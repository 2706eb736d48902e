"""Lookups of the shared tier, on the worker: plan a prompt's lookup, run a small one at once
or hand it to the lookup thread while the head waits (``Blocked``), reserve host slabs for a hit,
and adopt the copied hit host-only (the index's ``adopt_host_*``) or give its slabs back.

The lookup thread's side is :mod:`hpc_cli.engine.shared.find` (the store query) and
:meth:`Lookups._lookup_loop` (its queue of lookups and copies)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from hpc_cli.cache.keys import BLOCK_TOKENS, PreparedPrompt
from hpc_cli.cache.shared import SnapshotPayload
from hpc_cli.cache.tree import BlockNode
from hpc_cli.engine.binding import Blocked
from hpc_cli.engine.shared.health import Health
from hpc_cli.shared_store import SharedStore, SharedStoreUnavailable

if TYPE_CHECKING:
    import collections

    from hpc_cli.engine.hybrid import HybridBinding
    from hpc_cli.engine.lane import Lane
    from hpc_cli.engine.shared.tier import SharedTierConfig

log = logging.getLogger("hpc_cli.engine.shared")


class Defer(Exception):
    """A lookup on the worker found more bytes to read than SYNC_FETCH_BYTES: hand it over."""


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
class Lookup:
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
class Landing:
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



class Lookups:
    """The tier's lookup side (mixed into :class:`~hpc_cli.engine.shared.tier.SharedTier`, which
    sets these attributes up)."""

    cache: "HybridBinding"
    store: SharedStore
    probe_store: SharedStore
    config: "SharedTierConfig"
    health: Health
    wake: Callable[[], None]
    image_slabs: int
    slab_bytes: int
    misses: "collections.Counter[str]"
    counts: "collections.Counter[str]"
    lookup_seconds: float
    _lookup: Lookup | None
    _landing: Landing | None
    _abandoned: list[Landing]
    _looked_up: "Lane | None"
    _jobs: "queue.Queue[Lookup | Landing | None]"
    _closed: bool

    # ------------------------------------------------------------------ lookups (worker side)
    def _plan(self, lane: "Lane") -> Lookup | None:
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
        return Lookup(lane, prompt, local, len(m.path), index.host.ready_slabs, now, now + self.config.timeout_s)

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

    def _submit(self, job: Lookup) -> None:
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
            except Defer:
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

    def _reserve(self, lane: "Lane", hit: Hit) -> Landing | None:
        """Reserve host slabs for a hit under the prompt's path as the index has it now (other
        lanes may have committed or evicted blocks meanwhile), or None (counted as a miss)."""
        index = self.cache.index
        path = index.match(lane.prepared).path
        a = hit.anchor
        if holds(path, hit):
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
        return Landing(lane, hit, len(path), new, slabs[:len(new)], slabs[len(new):len(new) + self.image_slabs],
                        slabs[-1] if tail else -1)

    def _copy(self, landing: Landing) -> None:
        """Copy a hit's bytes into its reserved slabs (the lookup thread; nothing else touches
        reserved slabs)."""
        host, hit, sb = self.cache.host, landing.hit, self.slab_bytes
        for b, s in zip(landing.new, landing.block_slabs):
            copy_in(host.slab_view(s).numpy(), hit.blocks[b])
        image = hit.snapshot.image
        for i, s in enumerate(landing.image_slabs):
            copy_in(host.slab_view(s).numpy(), image[i * sb:(i + 1) * sb])
        if landing.tail_slab >= 0:
            copy_in(host.slab_view(landing.tail_slab).numpy(), hit.snapshot.tail)

    def _land(self, landing: Landing) -> None:
        """Adopt a copied hit host-only, if the prompt's path is still the one its slabs were
        reserved under; else give the slabs back. The ordinary quote and restore follow."""
        index = self.cache.index
        prompt = landing.lane.prepared
        hit = landing.hit
        path = index.match(prompt).path
        why = ("copy_failed" if landing.error is not None else "path_changed" if len(path) != landing.path_len
               else "already_local" if holds(path, hit) else None)
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
            if isinstance(job, Landing):
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

def holds(path: list[BlockNode], hit: Hit) -> bool:
    """Whether the prompt's matched ``path`` already has the hit's snapshot."""
    return len(path) > hit.anchor and any(s.frontier == hit.frontier and s.tail_tokens == hit.tail_tokens
                                          for s in path[hit.anchor].snapshots)


def copy_in(dst: np.ndarray, src: memoryview | bytes) -> None:
    n = len(src)
    dst[:n] = np.frombuffer(src, dtype=np.uint8)

