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
