"""Hypothesis state machine: match, publish, commit, release, evict, supersede, lose a copy and
pin/unpin interleaved at random, with check_invariants() after every step.

The CI profile runs at least 300 sequences; ``-m slow`` runs ten times more.
"""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hpc_cli.cache import PrefixIndex, Readiness, SnapshotKind, prepare_prompt

from .sim import TOKEN_COST, Sim, blocks_of, geometry

prompt_st = st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(0, 40))


class CacheMachine(RuleBasedStateMachine):
    @initialize(host_slabs=st.sampled_from([0, 8, 14, 40]), slots=st.integers(1, 3),
                pages=st.integers(24, 60))
    def setup(self, host_slabs, slots, pages):
        self.ix = PrefixIndex(geometry(host_slabs=host_slabs, slots=slots, image_slabs=3), TOKEN_COST)
        self.sim = Sim(self.ix, total_pages=pages, auto_land=False)
        self.lanes = []

    def tokens(self, p):
        chunks, tail = p
        return blocks_of(*chunks) + list(range(7000, 7000 + tail))

    @rule(p=prompt_st)
    def match(self, p):
        toks = self.tokens(p)
        prompt = prepare_prompt(toks)
        m = self.ix.match(prompt)
        for b, n in enumerate(m.path):
            assert n.tokens == prompt.blocks[b] and n.depth == b  # exact identity
        for s in m.candidates:
            assert s.alive and s.frontier <= len(toks) - 1
            assert s.anchor.depth < m.k
            assert s.tail_tokens == prompt.tokens[4 * (s.frontier - s.tail_len):4 * s.frontier]

    @precondition(lambda self: len(self.lanes) < 3)
    @rule(p=prompt_st)
    def admit(self, p):
        toks = self.tokens(p)
        lane, q = self.sim.admit(toks)
        if lane is not None:
            self.lanes.append(lane)
            assert q.reuse_tokens <= len(toks) - 1 or q.reuse_tokens == 0
        else:
            assert q.readiness is not Readiness.READY

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 2), blocks=st.integers(1, 3))
    def commit(self, i, blocks):
        lane = self.lanes[i % len(self.lanes)]
        upto = min(len(lane.tokens), (len(lane.seq.nodes) + blocks) * 64)
        self.sim.commit(lane, upto)

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 2), at=st.integers(1, 400), boundary=st.booleans())
    def publish(self, i, at, boundary):
        lane = self.lanes[i % len(self.lanes)]
        f = min(at, len(lane.tokens))
        if f < len(lane.seq.nodes) * 64 - 63 or f % 64 and not self._page():
            return
        if f < len(lane.seq.nodes) * 64:
            f = len(lane.seq.nodes) * 64  # blocks already committed: publish at the frontier
        if f > len(lane.tokens):
            return
        if f % 64 and not self._page():
            return
        if len(lane.pages) < -(-f // 64) - len(lane.seq.nodes) and not self._page(-(-f // 64)):
            return
        self.sim.tap(lane, f, SnapshotKind.BOUNDARY if boundary else SnapshotKind.TAP)

    def _page(self, k=1):
        if self.sim.mem.n_free < k:
            self.sim.free(self.ix.evict_device(k - self.sim.mem.n_free))
        return self.sim.mem.n_free >= k

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 2), endpoint=st.booleans(), wt=st.booleans())
    def release(self, i, endpoint, wt):
        lane = self.lanes.pop(i % len(self.lanes))
        if lane.restore is not None and lane.restore in self.sim.pending_restores:
            self.sim.pending_restores.remove(lane.restore)  # a lane waits for its own restore
            self.ix.land_restore(lane.restore)
        done = len(lane.seq.nodes)
        left = len(lane.tokens) // 64 - done
        tail = len(lane.tokens) % 64
        want = left + (1 if endpoint and tail else 0)
        if len(lane.pages) < want:
            self._page(want - len(lane.pages))
        have = len(lane.pages) + self.sim.mem.n_free
        ep = None
        if endpoint and tail and have >= want:
            ep = len(lane.tokens)
        elif have < left:
            lane.tokens = lane.tokens[:64 * (done + have)]  # cancelled: commit what fits
        self.sim.finish(lane, endpoint=ep, write_through=wt)

    @precondition(lambda self: self.sim.pending_writes or self.sim.pending_restores)
    @rule(i=st.integers(0, 5))
    def land(self, i):
        pend = self.sim.pending_writes + self.sim.pending_restores
        b = pend[i % len(pend)]
        if b in self.sim.pending_writes:
            self.sim.pending_writes.remove(b)
            self.ix.land_write(b)
        else:
            self.sim.pending_restores.remove(b)
            for lane in self.lanes:
                if lane.restore is b:
                    lane.restore = None
            self.ix.land_restore(b)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        pinned_before = [(x, x.device_pages) for x in self.ix.tree.walk() if x.pinned]
        freed = self.ix.evict_device(n)
        self.sim.free(freed)
        for x, pages in pinned_before:
            assert x.alive and x.device_pages == pages, f"pinned {x!r} was evicted"
            assert pages is None or pages not in freed.pages

    @precondition(lambda self: self.ix.snapshots)
    @rule(i=st.integers(0, 50))
    def supersede(self, i):
        snaps = list(self.ix.snapshots.values())
        self.ix.supersede(snaps[i % len(snaps)])

    @precondition(lambda self: self.ix.tree.size)
    @rule(i=st.integers(0, 200), device=st.booleans(), host=st.booleans())
    def lose_a_copy(self, i, device, host):
        nodes = [n for n in self.ix.tree.walk() if not n.pinned]
        if not nodes or not (device or host):
            return
        node = nodes[i % len(nodes)]
        deletes = (not node.has_device or device) and (not node.has_host or host)
        if deletes and self.ix.residency.subtree_pinned(node):
            return
        below = set()
        stack = [node]
        while stack:
            x = stack.pop()
            below.update(x.snapshots)
            stack.extend(x.iter_children())
        freed = self.ix.drop_copy(node, device=device, host=host)
        self.sim.free(freed)
        if deletes:
            assert not node.alive and all(not s.alive for s in below)
            assert freed.snapshots_deleted == len(below)

    @precondition(lambda self: self.ix.tree.size)
    @rule(p=prompt_st)
    def pin_unpin(self, p):
        """A hit that is staged and cancelled at once: pins, then unpins (and touches MRU)."""
        toks = self.tokens(p)
        lane, q = self.sim.admit(toks, extra_pages=0)
        if lane is not None:
            pinned = list(lane.seq.nodes)
            assert all(n.active_refs > 0 and n.lru_list is None for n in pinned)
            if lane.restore is not None:
                self.sim.pending_restores.remove(lane.restore)
                self.ix.land_restore(lane.restore)
            rel = self.ix.release(lane.seq, write_through=False)
            self.sim.mem.give_back(rel.free_pages + lane.pages)
            self.sim.free(rel.freed)

    @invariant()
    def invariants(self):
        if hasattr(self, "ix"):
            self._check()

    def _check(self):
        self.ix.check_invariants()
        # every page bundle is free, cached by the index, or held by a lane
        cached = sum(1 for n in self.ix.tree.walk() if n.device_pages is not None)
        cached += sum(1 for s in self.ix.snapshots.values() if s.tail_pages is not None)
        held = sum(len(l.pages) + len(l.seq.duplicate_pages) for l in self.lanes)
        assert cached + held + self.sim.mem.n_free == self.sim.mem.total, \
            f"pages leak: cached {cached} + lanes {held} + free {self.sim.mem.n_free} != {self.sim.mem.total}"

    def teardown(self):
        if not hasattr(self, "ix"):
            return
        for lane in list(self.lanes):
            if lane.restore is not None and lane.restore in self.sim.pending_restores:
                self.sim.pending_restores.remove(lane.restore)
                self.ix.land_restore(lane.restore)
            lane.tokens = lane.tokens[:64 * len(lane.seq.nodes)]
            self.sim.finish(lane, write_through=False)
        self.lanes = []
        self.sim.land_all()
        self._check()
        assert not self.ix.sequences and not self.ix.writes and not self.ix.restores
        self.ix.check_invariants()


CacheMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
test_cache_state_machine = CacheMachine.TestCase


@pytest.mark.slow
def test_cache_state_machine_slow():
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(CacheMachine, settings=settings(
        settings.default, max_examples=10 * settings.default.max_examples, stateful_step_count=40))
