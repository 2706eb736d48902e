"""The round tail's greedy counts (hpc_cli/speculative/round_tail.py): the device's count of a
verdict is the drafts equal to their column's argmax before the first that is not."""

import random

import torch

from hpc_cli.speculative.round_tail import greedy_counts


def test_greedy_counts_on_the_device_are_the_leading_matches():
    rng = random.Random(3)
    for k in (1, 2, 3, 5):
        rows = []
        for _ in range(64):
            argmax = [rng.randrange(4) for _ in range(k + 1)]  # few tokens: many drafts match
            drafts = [a if rng.random() < 0.6 else rng.randrange(4) for a in argmax[:k]]
            rows.append(drafts + argmax)
        got = greedy_counts(torch.tensor(rows)).tolist()
        # the leading matches, as the host counts them; a draft that matches after the first
        # mismatch is not counted
        assert got == [next((i for i in range(k) if r[i] != r[k + i]), k) for r in rows], k
    assert greedy_counts(torch.tensor([[7, 8, 9, 7, 8, 0, 1]])).tolist() == [2]  # k = 3: two, then a miss
    assert greedy_counts(torch.tensor([[5, 6, 7, 5, 6, 7, 9]])).tolist() == [3]  # every draft, then the bonus
    assert greedy_counts(torch.tensor([[4, 5, 6, 1, 5, 6, 2]])).tolist() == [0]  # the first is missed


def test_a_chained_verify_index_is_the_one_the_host_builds_after_accepting():
    """The next round's verify index chosen on the device (ops.fill_chained: each lane's variant
    at its greedy count, its first token the argmax there, the drafts proposed ahead) is, value for
    value, the packed index the host builds for that round once it has accepted the counts; with
    lanes of different counts, lengths and page tables, at one to three drafts."""
    from hpc_cli.model.columns import ColumnIndex, table_width
    from hpc_cli.speculative.ops import fill_chained, lanes_of

    rng = random.Random(5)
    page = 64
    for k in (1, 2, 3):
        T = k + 1
        for B in (1, 2, 3):
            pos = [rng.randrange(1, 900) for _ in range(B)]
            pages = [rng.sample(range(1000), (p + 2 * k + 1) // page + 1) for p in pos]
            starts = [[p + c + 1 for p in pos] for c in range(T)]
            tables = [[pg[:-(-(s + T) // page)] for pg, s in zip(pages, row)] for row in starts]
            widths = {table_width(tb, st, T, page) for st, tb in zip(starts, tables)}
            if len(widths) != 1:
                continue
            W = widths.pop()
            slots = rng.sample(range(8), B)
            zero = [[0] * T for _ in range(B)]
            variants = torch.stack([ColumnIndex.pack(zero, st, tb, slots, page, W) for st, tb in zip(starts, tables)])
            argmax = [[rng.randrange(50) for _ in range(T)] for _ in range(B)]
            counts = [rng.randrange(T) for _ in range(B)]
            # drafts that match the argmax exactly up to each lane's count
            verdict = torch.tensor([[a[i] if i < c else a[i] + 1 for i in range(k)] + a
                                    for a, c in zip(argmax, counts)])
            drafts = torch.tensor([[rng.randrange(50) for _ in range(k)] for _ in range(B)])
            idx = ColumnIndex.view(torch.full_like(variants[0], -7), B, T, W)
            fill_chained(idx, variants, lanes_of(B, T, W, torch.device("cpu")), verdict, drafts)
            # what the host packs after accepting: lane b at start pos + count + 1, its first
            # token the argmax at its count, then the drafts
            host = ColumnIndex.pack([[a[c]] + d for a, c, d in zip(argmax, counts, drafts.tolist())],
                                    [p + c + 1 for p, c in zip(pos, counts)],
                                    [tables[c][b] for b, c in enumerate(counts)], slots, page, W)
            assert idx.packed.tolist() == host.tolist(), (k, B, counts)
