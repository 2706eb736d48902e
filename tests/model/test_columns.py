"""hpc_cli.model.columns on the CPU: a decode column steps the lanes' GDN states where they lie in
their slots when the slots are one run (no gather, copy and scatter), with the same bits as the
gathered path, and other slots untouched; lanes in scattered slots take the gathered path."""

from __future__ import annotations

import pytest
import torch

import hpc_cli.model.columns as columns
from hpc_cli.model.model import HybridModel


@pytest.fixture(scope="module")
def model():
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, progress=False)


def _decode(model, slots: list[int], in_place: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(columns, "_slot_run", columns._slot_run if in_place else (lambda slot_t: None))
    kv = model.new_kv_storage("bf16", 16)
    states = model.new_state_slots(5)
    prompts = [list(range(3, 70)), list(range(9, 60))]
    tables = [[0, 1], [2, 3]]
    for p, t, s in zip(prompts, tables, slots):
        model.prefill(p, 0, t, s, kv, states)
    before = {i: states.recurrent_all[:, i].clone() for i in range(5) if i not in slots}
    logits = []
    for step in range(3):
        pos = [len(p) + step for p in prompts]
        logits.append(model.decode([5 + step, 7 + step], pos, tables, slots, kv, states))
    for i, st in before.items():
        assert torch.equal(states.recurrent_all[:, i], st), f"slot {i} was touched"
    return torch.stack(logits), states.recurrent_all[:, slots].clone()


@pytest.mark.parametrize("slots", [[1, 2], [3, 1]])
def test_decode_in_place_equals_the_gathered_path(model, slots, monkeypatch):
    got_logits, got_states = _decode(model, slots, True, monkeypatch)
    want_logits, want_states = _decode(model, slots, False, monkeypatch)
    assert torch.equal(got_logits, want_logits) and torch.equal(got_states, want_states)


def test_slot_run():
    assert columns._slot_run(torch.tensor([2, 3, 4])) == 2
    assert columns._slot_run(torch.tensor([0])) == 0
    assert columns._slot_run(torch.tensor([3, 1])) is None
    assert columns._slot_run(torch.tensor([1, 3])) is None
