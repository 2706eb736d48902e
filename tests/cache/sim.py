"""A tiny stand-in for the engine and memory layer around PrefixIndex: it owns page bundles,
runs requests through quote/stage/restore/activate/commit/publish/release, and lands transfers
when told to."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_cli.cache import (
    BLOCK_TOKENS, CacheCostModel, CacheGeometry, PrefixIndex, Readiness, SnapshotKind,
    prepare_prompt, token_bytes,
)
from hpc_cli.cache.records import Freed, RestoreBatch, SequencePath, WriteBatch

BLOCK = BLOCK_TOKENS
#: prefill cost = tokens (seconds); restores free: C(s) = F_s - F_a exactly
TOKEN_COST = CacheCostModel(prefill_signature="test", chunk_tokens=1 << 30, chunk_seconds=0.0,
                            token_seconds=1.0, pair_seconds=0.0,
                            h2d_bytes_per_second=float("inf"), restore_batch_seconds=0.0)


def geometry(*, host_slabs: int = 64, slots: int = 3, image_slabs: int = 3, pools: int = 2,
             block_bytes: int = 4096) -> CacheGeometry:
    return CacheGeometry(block_bytes=block_bytes, image_bytes=image_slabs * block_bytes,
                         device_snapshot_slots=slots, host_bytes=host_slabs * block_bytes,
                         num_pools=pools)


class Pages:
    """Device page bundles: bundle i is (i, 100000+i, ...) across pools."""

    def __init__(self, total: int, pools: int) -> None:
        self.total = total
        self.pools = pools
        self.free: list[int] = list(range(total - 1, -1, -1))

    def alloc(self) -> tuple[int, ...]:
        i = self.free.pop()
        return tuple(i + 100000 * p for p in range(self.pools))

    def give_back(self, bundles) -> None:
        for b in bundles:
            assert b[0] not in self.free, f"bundle {b} freed twice"
            self.free.append(b[0])

    @property
    def n_free(self) -> int:
        return len(self.free)


def blocks_of(*chunks: int) -> list[int]:
    """Tokens of whole blocks: each chunk id c gives the block [c*1000 .. c*1000+63]."""
    out: list[int] = []
    for c in chunks:
        out += range(c * 1000, c * 1000 + BLOCK)
    return out


def publish_tap(ix: PrefixIndex, sim: Sim, toks: list[int], frontier: int, seq=None):
    """Commit ``toks``' blocks up to ``frontier`` on ``seq`` (a new sequence when None) and
    publish a tap there. Returns the sequence, the PublishResult and the SlotGrant (None, None
    when no slot was granted)."""
    seq = seq or ix.begin_sequence()
    while len(seq.nodes) < frontier // 64:
        b = len(seq.nodes)
        ix.commit_block(seq, token_bytes(toks[64 * b:64 * b + 64]), sim.mem.alloc())
    g = ix.acquire_snapshot_slot(seq, SnapshotKind.TAP, frontier)
    if g is None:
        return seq, None, None
    sim.free(g.freed)
    pr = ix.publish(seq, SnapshotKind.TAP, frontier, slot=g.slot)
    sim.free(pr.freed)
    return seq, pr, g


@dataclass
class Lane:
    seq: SequencePath
    tokens: list[int]
    pages: list[tuple[int, ...]] = field(default_factory=list)  # private pages: growth, tails
    restore: RestoreBatch | None = None


class Sim:
    def __init__(self, ix: PrefixIndex, total_pages: int = 256, *, auto_land: bool = True) -> None:
        self.ix = ix
        self.mem = Pages(total_pages, ix.geometry.num_pools)
        self.auto_land = auto_land
        self.pending_writes: list[WriteBatch] = []
        self.pending_restores: list[RestoreBatch] = []

    def free(self, freed: Freed) -> None:
        self.mem.give_back(freed.pages)

    def admit(self, tokens: list[int], *, extra_pages: int = 1, media=()):
        """Quote, stage, restore and activate; returns (lane, quote) or (None, quote)."""
        ix = self.ix
        prompt = prepare_prompt(tokens, media)
        ent = -(-len(tokens) // BLOCK) + extra_pages
        q = ix.quote(prompt, entitlement_pages=ent, free_pages=self.mem.n_free, total_pages=self.mem.total)
        if q.readiness is not Readiness.READY:
            return None, q
        st = ix.stage(q, free_pages=self.mem.n_free)
        self.free(st.freed)
        assert st.short_pages == 0
        rb = ix.begin_restore(st, [self.mem.alloc() for _ in st.restore_blocks],
                              self.mem.alloc() if st.restore_tail else None)
        seq = ix.activate(st)
        lane = Lane(seq, list(tokens), restore=rb)
        if rb is not None:
            if self.auto_land:
                ix.land_restore(rb)
                lane.restore = None
            else:
                self.pending_restores.append(rb)
        # the lane's private pages: growth from F_s on (the index does not track these)
        need_private = ent - q.reuse_tokens // BLOCK
        lane.pages = [self.mem.alloc() for _ in range(need_private)]
        return lane, q

    def commit(self, lane: Lane, upto_tokens: int) -> list:
        """Commit every full block below ``upto_tokens`` not yet committed."""
        out = []
        while (len(lane.seq.nodes) + 1) * BLOCK <= upto_tokens:
            b = len(lane.seq.nodes)
            toks = lane.tokens[b * BLOCK:(b + 1) * BLOCK]
            from hpc_cli.cache import token_bytes
            page = lane.pages.pop(0) if lane.pages else self.mem.alloc()
            out.append(self.ix.commit_block(lane.seq, token_bytes(toks), page))
        return out

    def tap(self, lane: Lane, frontier: int, kind: SnapshotKind = SnapshotKind.TAP):
        ix = self.ix
        self.commit(lane, frontier)
        g = ix.acquire_snapshot_slot(lane.seq, kind, frontier)
        if g is None:
            return None
        self.free(g.freed)
        tail = frontier % BLOCK
        from hpc_cli.cache import token_bytes
        tail_tokens = token_bytes(lane.tokens[frontier - tail:frontier])
        tail_pages = (lane.pages.pop(0) if lane.pages else self.mem.alloc()) if tail else None
        pr = ix.publish(lane.seq, kind, frontier, slot=g.slot, tail_tokens=tail_tokens, tail_pages=tail_pages)
        self.free(pr.freed)
        if pr.write is not None:
            if self.auto_land:
                ix.land_write(pr.write)
            else:
                self.pending_writes.append(pr.write)
        return pr.snapshot

    def finish(self, lane: Lane, *, endpoint: int | None = None, write_through: bool = True):
        if endpoint is not None:
            self.tap(lane, endpoint, SnapshotKind.ENDPOINT)
        else:
            self.commit(lane, len(lane.tokens))
        rel = self.ix.release(lane.seq, write_through=write_through)
        self.mem.give_back(rel.free_pages)
        self.free(rel.freed)
        self.mem.give_back(lane.pages)
        lane.pages = []
        if rel.write is not None:
            if self.auto_land:
                self.ix.land_write(rel.write)
            else:
                self.pending_writes.append(rel.write)
        return rel

    def land_all(self) -> None:
        for w in self.pending_writes:
            self.ix.land_write(w)
        for r in self.pending_restores:
            self.ix.land_restore(r)
        self.pending_writes.clear()
        self.pending_restores.clear()

    def run(self, tokens: list[int], *, taps=(), endpoint: int | None = None, extra_pages: int = 1):
        lane, q = self.admit(tokens, extra_pages=extra_pages)
        assert lane is not None, q.readiness
        snaps = [self.tap(lane, p) for p in taps]
        self.finish(lane, endpoint=endpoint)
        return q, snaps
