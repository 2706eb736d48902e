"""The packed host indices of a column pass (hpc_cli.model.columns.ColumnIndex: plain Python for a
small index, numpy for a large one) and of a prefill pass (hpc_cli.model.prefill_core.PrefillIndex,
numpy), against the same layouts built with torch ops (the form they had before: independent
code, same numbers), over random lanes, spans, tables, rotary offsets and taps."""

from __future__ import annotations

import random

import pytest
import torch

from hpc_cli.model import columns
from hpc_cli.model.columns import ColumnIndex, table_width
from hpc_cli.model.prefill_core import PrefillIndex
from hpc_cli.model.prefill_core import table_width as prefill_table_width


def _columns_ref(tokens, starts, tables, slots, page, W, rope_offsets=None):
    B, T = tokens.shape
    t = torch.arange(T, dtype=torch.long)
    pos = torch.tensor(list(starts), dtype=torch.long)[:, None] + t[None, :]
    rope = pos if rope_offsets is None else pos + torch.tensor(list(rope_offsets), dtype=torch.long)[:, None]
    tab = torch.zeros(B, W, dtype=torch.long)
    for b, bt in enumerate(tables):
        tab[b, :min(len(bt), W)] = torch.tensor(list(bt[:W]), dtype=torch.long)
    write = tab.gather(1, pos // page) * page + pos % page
    row_tables = [tab.repeat_interleave(T, 0).reshape(-1)] if T > 1 else []
    return torch.cat([tokens.reshape(-1).long(), rope.reshape(-1), torch.tensor(list(slots), dtype=torch.long),
                      write.reshape(-1), (pos + 1).reshape(-1), tab.reshape(-1), *row_tables])


def _prefill_ref(tokens, start, block_table, state_slot, L, W, page, k1, taps, slots):
    tok = torch.as_tensor(tokens, dtype=torch.long)
    n = tok.shape[0]
    n_pages = (start + n + page - 1) // page
    pos = start + torch.arange(L, dtype=torch.long)
    pages = torch.zeros(W, dtype=torch.long)
    pages[:n_pages] = torch.as_tensor(list(block_table[:n_pages]), dtype=torch.long)
    write = pages.gather(0, (pos // page).clamp(max=W - 1)) * page + pos % page
    write[n:] = -1
    padded = torch.zeros(L, dtype=torch.long)
    padded[:n] = tok
    conv = n + torch.arange(k1, dtype=torch.long)
    at, dst = [p for p, _ in taps], [d for _, d in taps]
    free = slots - len(at)
    cols = [conv] + [p + torch.arange(k1, dtype=torch.long) for p in at] + [conv] * free
    return torch.cat([padded, pos, write, pages, torch.tensor([start, n, state_slot, *dst, *([state_slot] * free), n - 1]),
                      torch.tensor([*(p - 1 for p in at), *([n - 1] * free)], dtype=torch.long),
                      torch.cat(cols), torch.tensor([*at, *([0] * free)], dtype=torch.long)])


@pytest.mark.parametrize("small_index", [10**9, 0], ids=["lists", "numpy"])
def test_column_index_equals_the_torch_layout(monkeypatch, small_index):
    monkeypatch.setattr(columns, "SMALL_INDEX", small_index)
    rng = random.Random(0)
    for _ in range(60):
        B, T, page = rng.randint(1, 8), rng.randint(1, 5), 64
        starts = [rng.randrange(0, 3000) for _ in range(B)]
        tables = [rng.sample(range(5000), (s + T - 1) // page + 1 + rng.randint(0, 3)) for s in starts]
        slots = rng.sample(range(64), B)
        tokens = torch.randint(0, 50000, (B, T))
        rope = [rng.randrange(-50, 50) for _ in range(B)] if rng.random() < 0.3 else None
        W = table_width(tables, starts, T, page)
        got = ColumnIndex.pack(tokens, starts, tables, slots, page, W, rope)
        want = _columns_ref(tokens, starts, tables, slots, page, W, rope)
        assert got.dtype == torch.long and torch.equal(got, want)
        assert list(ColumnIndex.pack_values(tokens.tolist(), starts, tables, slots, page, W, rope)) == want.tolist()
        idx = ColumnIndex.view(got, B, T, W)  # the fields the passes read, lane-major
        pos = [[s + t for t in range(T)] for s in starts]
        assert idx.seqlens.tolist() == [[p + 1 for p in row] for row in pos]
        assert idx.write.tolist() == [[tables[b][p // page] * page + p % page for p in row]
                                      for b, row in enumerate(pos)]
        assert [r[:len(tables[b // T])] for b, r in enumerate(idx.row_tables.tolist())] == \
            [list(tables[b // T][:W]) for b in range(B * T)]


def test_prefill_index_equals_the_torch_layout():
    rng = random.Random(1)
    for _ in range(60):
        page, k1 = 64, 3
        L = rng.choice([64, 512, 2048])
        n = rng.randint(1, L)
        start = rng.randrange(0, 5000)
        table = rng.sample(range(9000), (start + n + page - 1) // page + rng.randint(0, 2))
        slots = rng.choice([0, 4])
        at = sorted(rng.sample(range(1, n), min(slots, rng.randint(0, 4), n - 1))) if slots and n > 1 else []
        taps = [(p, 10 + j) for j, p in enumerate(at)]
        tokens = [rng.randrange(0, 50000) for _ in range(n)]
        W = prefill_table_width((start + n + page - 1) // page)
        got = PrefillIndex.pack(tokens, start, table, 2, L, W, page, k1, taps, slots)
        want = _prefill_ref(tokens, start, table, 2, L, W, page, k1, taps, slots)
        assert got.dtype == torch.long and torch.equal(got, want)
        assert torch.equal(PrefillIndex.pack(torch.tensor(tokens), start, table, 2, L, W, page, k1, taps, slots), want)
