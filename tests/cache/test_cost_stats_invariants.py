import json

import pytest

from hpc_cli.cache import CacheCostModel, PrefixIndex, preset
from hpc_cli.engine.stats_types import to_json
from hpc_cli.errors import ConfigError

from .sim import TOKEN_COST, Sim, blocks_of, geometry


def test_prefill_seconds_is_chunks_tokens_and_attention_pairs():
    m = CacheCostModel(chunk_tokens=100, chunk_seconds=1.0, token_seconds=0.5, pair_seconds=0.01)
    # base 10, 150 tokens: 2 chunks, 150 tokens, 10*150 + 150*151/2 = 12825 pairs
    assert m.prefill_seconds(10, 150) == pytest.approx(2 + 75 + 128.25)
    assert m.prefill_seconds(10, 0) == 0.0
    r = CacheCostModel(h2d_bytes_per_second=1e9, restore_batch_seconds=1e-3)
    assert r.restore_seconds(2e9) == pytest.approx(2.001) and r.restore_seconds(0) == 0.0


def test_presets_and_unknown_preset():
    assert preset("generic").prefill_signature == "generic"
    assert preset("rtx5090-27b").h2d_bytes_per_second < preset("h200-27b").h2d_bytes_per_second
    with pytest.raises(ConfigError) as e:
        preset("nope")
    assert "generic" in e.value.hint


def test_stats_are_json_and_count_by_residency():
    ix = PrefixIndex(geometry(), TOKEN_COST)
    sim = Sim(ix)
    sim.run(blocks_of(1, 2, 3) + [0], taps=[128])
    st = json.loads(json.dumps(to_json(ix.stats())))  # the engine's stats carry it as cache.index
    assert st["nodes"]["total"] == 3 and st["nodes"]["both"] == 3
    assert st["snapshots"]["by_kind"] == {"tap": 1}
    assert st["host"]["slabs_by_use"]["node"] == 3 and st["host"]["slabs_by_use"]["image"] == 3
    assert st["device"]["lru_backed"] == 3 and st["counters"]["commits"] == {"inserted": 3}


def test_check_invariants_catches_corruption():
    ix = PrefixIndex(geometry(), TOKEN_COST)
    sim = Sim(ix)
    _, (s,) = sim.run(blocks_of(1, 2, 3) + [0], taps=[128])
    ix.check_invariants()
    node = s.anchor
    node.live_snapshots_below += 1
    with pytest.raises(AssertionError, match="live_snapshots_below"):
        ix.check_invariants()
    node.live_snapshots_below -= 1
    node.active_refs += 1
    with pytest.raises(AssertionError, match="active_refs"):
        ix.check_invariants()
    node.active_refs -= 1
    ix.lru_backed.remove(node)
    with pytest.raises(AssertionError, match="LRU"):
        ix.check_invariants()


def test_running_tally_equals_a_full_recount_through_transfers_and_evictions():
    """The gauges the stepping path reads are kept as the state changes: at every point of a
    run with transfers in flight, restores, evictions and deletions they equal a full walk."""
    from hpc_cli.cache import stats

    ix = PrefixIndex(geometry(host_slabs=24), TOKEN_COST)
    sim = Sim(ix, total_pages=12, auto_land=False)

    def same() -> stats.IndexStats:
        ix.check_invariants()  # compares ix.tally with stats.recount(ix)
        assert ix.stats() == ix.stats(recount=True)
        return ix.stats()

    lane, _ = sim.admit(blocks_of(1, 2, 3) + [0])
    sim.tap(lane, 128)
    sim.finish(lane)
    st = same()
    assert st.transfers.writes == 2 and st.nodes.filling == {"host": 3}
    assert ix.tally.write_bytes == stats.inflight_bytes(ix).write_bytes > 0
    sim.land_all()
    same()
    for k in range(4, 9):  # more prompts than the device pages: backed evictions, host GDSF
        sim.run(blocks_of(k, k + 1, k + 2) + [0], taps=[128])
        same()
        sim.land_all()
        same()
    lane, q = sim.admit(blocks_of(5, 6, 7) + [5])  # a host-only path and image: a restore in flight
    assert len(q.restore_blocks) == 2 and q.restore_image
    st = same()
    assert st.nodes.filling.get("device") == 2
    assert ix.tally.restore_bytes == stats.inflight_bytes(ix).restore_bytes > 0
    c = st.counters
    assert c.device_evictions_backed and c.host_gdsf_evictions and c.nodes_deleted
    sim.land_all()
    sim.finish(lane)
    sim.land_all()
    st = same()
    assert st.nodes.pinned == 0 and ix.tally.restore_bytes == ix.tally.write_bytes == 0


def test_check_invariants_catches_a_drifted_tally():
    ix = PrefixIndex(geometry(), TOKEN_COST)
    Sim(ix).run(blocks_of(1, 2, 3) + [0], taps=[128])
    ix.check_invariants()
    ix.tally.nodes[3] += 1  # a missed update somewhere
    with pytest.raises(AssertionError, match="tally drifted.*nodes"):
        ix.check_invariants()
    ix.tally.nodes[3] -= 1
    ix.tally.snapshots_by_kind["endpoint"] -= 1
    with pytest.raises(AssertionError, match="snapshots_by_kind"):
        ix.check_invariants()
    ix.tally.snapshots_by_kind["endpoint"] += 1
    ix.host._by_use[1] += 1  # the host pool's slabs-by-use counts are checked the same way
    with pytest.raises(AssertionError, match="slabs by use"):
        ix.check_invariants()


def test_summary_reads_no_node_snapshot_or_slab(monkeypatch):
    """stats.summary (what the engine publishes) is O(1): no walk of the tree, the snapshots
    or the slabs."""
    from hpc_cli.cache import stats
    from hpc_cli.cache.tree import BlockTree

    ix = PrefixIndex(geometry(), TOKEN_COST)
    Sim(ix).run(blocks_of(1, 2, 3) + [0], taps=[128])
    walked = []
    monkeypatch.setattr(BlockTree, "walk", lambda self: walked.append("tree") or iter(()))
    monkeypatch.setattr(stats, "recount", lambda index: walked.append("recount"))
    monkeypatch.setattr(type(ix.host), "use_of", lambda self, s: walked.append("slab"))
    monkeypatch.setattr(type(ix.host), "recount_by_use", lambda self: walked.append("slabs"))
    st = stats.summary(ix)
    assert walked == [] and st.nodes.total == 3 and st.snapshots.by_kind == {"tap": 1}
