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


@pytest.mark.parametrize("B,H,T", [(1, 4, 4), (2, 48, 3), (3, 12, 2)])
def test_a_run_of_the_rule_keeps_each_tokens_state_as_its_own_run_would(B, H, T):
    """recurrent_rule over T tokens with ``keep``: token t's output and kept state equal, bit for
    bit, a one-token run from the state before it (what a verify pass's columns and decode must
    share), at the widths of builtin:tiny and the 27B mixers' 48 value heads."""
    from hpc_cli.model.gdn import recurrent_rule

    g = torch.Generator().manual_seed(B * 100 + H + T)
    n_k, dk, dv = H // 2 if H > 4 else 2, 32, 16
    q, k = (torch.randn(B, T, n_k, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 3
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, dk, dv, generator=g)
    kept = torch.empty(B, T, H, dk, dv)
    out, final = recurrent_rule(q, k, v, decay, beta, s0.clone(), in_place=True, keep=kept)
    state = s0.clone()
    for t in range(T):
        o, state = recurrent_rule(*(x[:, t:t + 1].contiguous() for x in (q, k, v, decay, beta)), state)
        assert torch.equal(out[:, t:t + 1], o), t
        assert torch.equal(kept[:, t], state), t
    assert torch.equal(final, state)
