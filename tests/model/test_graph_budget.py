"""The CUDA graph cache's bookkeeping (hpc_cli.model.graphs), without a GPU: kept graphs stay
within the output budget and the count limit, least recently used dropped first, and a pass
whose outputs alone exceed the budget is never kept."""

from __future__ import annotations

import types

from hpc_cli.model import graphs as G


def _cache(budget: int) -> G.ColumnGraphs:
    cg = G.ColumnGraphs(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))
    assert cg.budget == 0, "no device memory on CPU: nothing would be kept"
    cg.budget = budget
    return cg


def _entry(nbytes: int) -> G._Graph:
    return G._Graph(graph=None, index=None, out=None, nbytes=nbytes)


def test_least_recently_used_graphs_leave_past_the_budget():
    cg = _cache(100)
    for k in "abc":
        assert cg._keep(k, _entry(40)) is not None
    assert list(cg.graphs) == ["b", "c"] and cg.held == 80 and cg.evictions == 1
    cg.graphs.move_to_end("b")  # a replay of b makes c the oldest
    cg._keep("d", _entry(40))
    assert list(cg.graphs) == ["b", "d"] and cg.held == 80 and cg.evictions == 2


def test_outputs_over_the_budget_run_eagerly():
    cg = _cache(100)
    assert cg._keep("big", _entry(101)) is None
    assert "big" in cg.eager and not cg.graphs and cg.held == 0


def test_count_limit(monkeypatch):
    monkeypatch.setattr(G, "MAX_GRAPHS", 3)
    cg = _cache(1 << 40)
    for k in range(5):
        cg._keep(k, _entry(1))
    assert list(cg.graphs) == [2, 3, 4] and cg.held == 3


def test_other_pools_drop_the_graphs():
    cg = _cache(1 << 30)
    kv1, st1 = types.SimpleNamespace(), types.SimpleNamespace()
    cg._bind(kv1, st1)
    cg._keep("a", _entry(10))
    cg.seen.add("a")
    cg._bind(kv1, st1)
    assert "a" in cg.graphs, "the same pools keep their graphs"
    kv2 = types.SimpleNamespace()
    cg._bind(kv2, st1)
    assert not cg.graphs and not cg.seen and cg.held == 0
    assert kv1._graph_serial != kv2._graph_serial
