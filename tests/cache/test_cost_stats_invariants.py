import json

import pytest

from hpc_cli.cache import CacheCostModel, PrefixIndex, preset
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
    st = json.loads(json.dumps(ix.stats()))
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
