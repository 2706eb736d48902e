"""§13.1 Admission arithmetic: fallback order, Blocked vs Infeasible, backfill, staleness."""

import pytest

from hpc_cli.cache import PrefixIndex, Readiness, StaleQuote, prepare_prompt
from hpc_cli.cache.cost import CacheCostModel
from hpc_cli.cache.admission import backfill_proof

from .sim import TOKEN_COST, Sim, blocks_of, geometry


def test_candidate_fallback_order_chosen_then_s_dev_then_root():
    cost = CacheCostModel(chunk_seconds=0.0, token_seconds=1.0, pair_seconds=0.0,
                          h2d_bytes_per_second=4096.0 * 1000, restore_batch_seconds=0.0)
    ix = PrefixIndex(geometry(slots=3), cost)
    sim = Sim(ix, total_pages=64)
    toks = blocks_of(1, 2, 3, 4, 5, 6, 7, 8) + list(range(10))
    lane, _ = sim.admit(toks)
    s_dev = sim.tap(lane, 128)
    sim.finish(lane, endpoint=460)  # endpoint with a 12-token tail, anchored on block 6
    p = prepare_prompt(toks)
    m = ix.match(p)
    s_end = m.candidates[-1]
    assert s_end.frontier == 460 and s_end.tail_len == 12
    # blocks 2..6 and the tail become host-only: s_end needs 5 + 1 restore destinations
    for n in m.path[2:7]:
        sim.free(ix.drop_copy(n, device=True))
    sim.mem.give_back([ix.residency.drop_device_tail(s_end)])
    assert ix.evictable_pages() == 2  # blocks 0 and 1
    F0 = sim.mem.n_free
    q = ix.quote(p, entitlement_pages=F0 + 1, free_pages=F0, total_pages=64)
    assert [c[0] for c in q.candidates] == [None, s_end, s_dev]
    assert q.ready and q.source is s_end  # the cheapest: restore 6 blocks, prefill 53 tokens
    assert q.restore_blocks == m.path[2:7] and q.restore_tail and not q.restore_image
    assert q.need_pages == F0 + 1 - 7 + 5 + 1 and q.available_pages == F0
    # s_end's destinations no longer fit: s_dev (no restore) comes next
    q = ix.quote(p, entitlement_pages=F0 + 2, free_pages=F0, total_pages=64)
    assert q.ready and q.source is s_dev and q.need_pages == F0 == q.available_pages
    q = ix.quote(p, entitlement_pages=F0 + 3, free_pages=F0, total_pages=F0 + 10)
    assert q.readiness is Readiness.TEMPORARILY_BLOCKED
    # without s_dev (its image slot dropped), the fallback after s_end is the root
    ix.residency.drop_device_image(s_dev)
    q = ix.quote(p, entitlement_pages=F0 + 2, free_pages=F0, total_pages=64)
    assert [c[0] for c in q.candidates] == [None, s_end]
    assert q.ready and q.source is None and q.reuse_tokens == 0 and q.need_pages == F0 + 2
    assert q.cached_prefix_tokens == 448
    ix.check_invariants()


def test_blocked_vs_infeasible_classification():
    ix = PrefixIndex(geometry(), TOKEN_COST)
    sim = Sim(ix, total_pages=32)
    p = prepare_prompt(blocks_of(1, 2) + [0])
    q = ix.quote(p, entitlement_pages=33, free_pages=32, total_pages=32)
    assert q.readiness is Readiness.PERMANENTLY_INFEASIBLE
    q = ix.quote(p, entitlement_pages=20, free_pages=10, total_pages=32)  # active lanes hold 22
    assert q.readiness is Readiness.TEMPORARILY_BLOCKED
    sim.run(blocks_of(5, 6, 7) + [0])  # 3 evictable cached pages now count as available
    q = ix.quote(p, entitlement_pages=13, free_pages=10, total_pages=32)
    assert q.readiness is Readiness.READY and q.available_pages == 13
    with pytest.raises(ValueError):
        ix.stage(ix.quote(p, entitlement_pages=20, free_pages=10, total_pages=32), free_pages=10)


def test_backfill_proof_on_constructed_states():
    # need(borrower) + need(head root) <= free + all evictable + donor entitlements released
    assert backfill_proof(4, 10, free_pages=6, evictable_pages=3, donor_released_pages=5)
    assert not backfill_proof(4, 10, free_pages=6, evictable_pages=3, donor_released_pages=4)
    ix = PrefixIndex(geometry(), TOKEN_COST)
    sim = Sim(ix, total_pages=20)
    sim.run(blocks_of(1, 2, 3) + [0])
    head = ix.quote(prepare_prompt(blocks_of(9) * 16 + [0]), entitlement_pages=19, free_pages=2, total_pages=20)
    assert head.readiness is Readiness.TEMPORARILY_BLOCKED
    assert not backfill_proof(2, head.need_pages, 2, ix.evictable_pages(), 10)
    assert backfill_proof(2, head.need_pages, 2, ix.evictable_pages(), 16)


def test_quote_staleness_via_cache_epoch():
    ix = PrefixIndex(geometry(host_slabs=0), TOKEN_COST)
    sim = Sim(ix, total_pages=64)
    sim.run(blocks_of(1, 2, 3) + [0], taps=[128])
    p = prepare_prompt(blocks_of(1, 2, 3) + [0])
    q = ix.quote(p, entitlement_pages=5, free_pages=sim.mem.n_free, total_pages=64)
    sim.free(ix.evict_device(1))  # the deepest block goes: the cache moved on
    with pytest.raises(StaleQuote):
        ix.stage(q, free_pages=sim.mem.n_free)
    q = ix.quote(p, entitlement_pages=5, free_pages=sim.mem.n_free, total_pages=64)
    st = ix.stage(q, free_pages=sim.mem.n_free)
    assert st.seq.nodes == q.path and q.reuse_tokens == 128
    ix.activate(st)
    ix.release(st.seq)
    ix.check_invariants()
