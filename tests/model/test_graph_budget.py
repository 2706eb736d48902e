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
    return G._Graph(graph=None, index=None, out=types.SimpleNamespace(static=0), nbytes=nbytes)


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
        cg._keep((k,), _entry(1))
    assert list(cg.graphs) == [(2,), (3,), (4,)] and cg.held == 3


def test_graphs_of_the_last_bindings_are_kept_past_them_dropped():
    """A model several engines use in turn keeps each binding's graphs (keyed by its pools'
    serials, so never replayed for other pools) and drops the least recently bound's past
    MAX_BINDINGS, with their bytes."""
    cg = _cache(10 ** 6)
    pools = [(types.SimpleNamespace(), types.SimpleNamespace()) for _ in range(G.MAX_BINDINGS + 1)]

    def keep(i: int) -> tuple:
        cg.bind(*pools[i])
        key = (cg.bound, 1, 1, 8)
        cg._keep(key, _entry(10))
        return key

    first, second = keep(0), keep(1)
    cg.bind(*pools[0])  # back to the first engine: its graph is still there
    assert first in cg.graphs and second in cg.graphs and first[0] != second[0]
    for i in range(2, G.MAX_BINDINGS + 1):
        keep(i)
    # the first was bound again after the second, so the second is the least recently bound
    assert second not in cg.graphs and first in cg.graphs, "the least recently bound pools' graphs go"
    assert len(cg.graphs) == G.MAX_BINDINGS and cg.held == 10 * G.MAX_BINDINGS, (len(cg.graphs), cg.held)


def test_a_pool_whose_graphs_are_all_gone_is_not_captured_into_again():
    """Once every graph of a memory pool is dropped (past the budget, or with its pools'
    binding), the next capture of that set makes a new pool: a pool without graphs cannot take a
    capture again."""
    cg = _cache(100)
    cg.pool, cg.second_pool, cg.fill_pool = "first pool", "second pool", "fill pool"
    second = G._Graph(graph=None, index=None, out=types.SimpleNamespace(static=7), nbytes=60)
    cg.second_serials.add(7)
    cg.fills[7] = "the second graph's fill"
    cg._keep(("a", "second"), second)
    assert cg.pool is None and cg.second_pool == "second pool", "no first graph is left: its pool goes"
    assert cg.fill_pool == "fill pool"
    cg.pool = "first pool"
    cg._keep(("b",), _entry(60))  # past the budget: the second graph goes, and with it its pool and fill
    assert list(cg.graphs) == [("b",)] and not cg.second_serials and not cg.fills and cg.held == 60
    assert cg.second_pool is None and cg.pool == "first pool", (cg.pool, cg.second_pool)
    assert cg.fill_pool is None, "the fills' pool lost its last graph: a new one takes the next fill"
