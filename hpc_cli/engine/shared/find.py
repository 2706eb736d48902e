"""The store query of a shared-tier lookup: read the anchor sets of the prompt's blocks (one
round trip), pick the deepest snapshot whose tail matches the prompt, read it with the path
blocks the index lacks (a second round trip) and check every value against the prompt
(namespace, size, checksum, tokens, path digest; :mod:`hpc_cli.cache.shared`)."""

from __future__ import annotations

import logging
import time

from hpc_cli.cache import shared as rec
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED
from hpc_cli.cache.shared import Miss, Namespace, RecordError
from hpc_cli.engine.shared.lookup import Defer, Hit, Lookup
from hpc_cli.shared_store import SharedStore

log = logging.getLogger("hpc_cli.engine.shared")

#: anchors whose sets one lookup reads at most (the deepest; 4096 blocks = 256k tokens)
MAX_ANCHORS = 4096
#: snapshots one lookup tries, deepest first, before it gives up
MAX_CANDIDATES = 4
#: a lookup runs on the worker itself (no thread hand-off, no wait for the next step) while what
#: it reads stays below this many bytes; larger hits go to the lookup thread while the head waits
SYNC_FETCH_BYTES = 32 << 20


class StoreSearch:
    """The tier's store query (mixed into :class:`~hpc_cli.engine.shared.tier.SharedTier`)."""

    ns: Namespace
    where: str
    image_slabs: int
    block_bytes: int
    image_bytes: int

    def _find(self, job: Lookup, store: SharedStore, sync: bool = False) -> tuple[Hit | None, str | None]:
        """The deepest usable snapshot for the job's prompt, with the path blocks it lacks;
        ``sync`` (on the worker) raises :class:`Defer` before reading more than SYNC_FETCH_BYTES."""
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
                raise Defer()
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

