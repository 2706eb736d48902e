"""The split MoE (resident from slots + misses from the host copy) equals the all-resident MoE."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model.expert_profile import build_profile, synthetic_trace, trace_counts
from hpc_cli.model.experts import NOT_RESIDENT, POLICIES, ExpertTier, expert_stats

from .helpers import tiny_moe

PROMPT = [3, 17, 99, 120, 5, 64, 200, 31, 8, 77, 150, 42, 9, 250, 11, 60]


def _profile(model, slots):
    c = model.config
    return build_profile(trace_counts(synthetic_trace(200, c.num_hidden_layers, c.num_experts,
                                                      c.num_experts_per_tok, 1.0), c.num_experts), slots)


def _decode_logits(model, prompt, steps=4):
    kv = model.new_kv_storage("bf16", 4, name="scratch")
    states = model.new_state_slots(1)
    out = model.prefill(prompt, 0, [0, 1, 2, 3], 0, kv, states)
    logits, nxt = [out.logits], int(out.logits.argmax())
    for i in range(steps):
        lg = model.decode([nxt], [len(prompt) + i], [[0, 1, 2, 3]], [0], kv, states)[0]
        logits.append(lg)
        nxt = int(lg.argmax())
    return torch.stack(logits)


@pytest.fixture(scope="module")
def reference():
    m = tiny_moe()
    return m.forward_tokens(PROMPT), _decode_logits(m, PROMPT)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_split_equals_all_resident(policy, fraction, reference):
    ref_prefill, ref_decode = reference
    m = tiny_moe()
    c = m.config
    slots = int(fraction * c.num_hidden_layers * c.num_experts)
    tier = ExpertTier(m, slots=slots, admission=policy, profile=_profile(m, slots), verify=True)
    assert all(layer.mlp.experts.gate_up_proj is None for layer in m.layers)  # the device copy is gone
    for _ in range(2):  # the second pass runs on what the first-routed policies admitted
        torch.testing.assert_close(m.forward_tokens(PROMPT), ref_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_decode_logits(m, PROMPT), ref_decode, rtol=1e-4, atol=1e-4)
    st = expert_stats(m)
    assert st["slots"] == slots and st["resident"] <= slots
    if slots == 0:
        assert st["hit_rate"] == 0.0
        assert st["host_bytes_per_token"] > 0
    if fraction == 1.0:
        assert st["resident"] > 0 and st["hit_rate"] > 0
        if policy == "profile":  # every ranked pair admitted before the first token
            assert st["resident"] == _profile(m, slots).n_ranked
    assert len(st["hit_rate_per_layer"]) == c.num_hidden_layers
    tier.verify_all()


def test_all_slots_resident_reads_nothing_from_host():
    m = tiny_moe()
    c = m.config
    n = c.num_hidden_layers * c.num_experts
    tier = ExpertTier(m, slots=n, admission="per-layer-first-routed")
    # admit everything up front: then no token misses
    for layer in range(c.num_hidden_layers):
        for e in range(c.num_experts):
            slot = tier.cache.admit(layer, e, tier.host[layer].blob)
            tier.cache.fill_slot_blocking(slot, tier.host[layer].packed[e], tier.host[layer].blob)
    tier.verify_all()
    m.forward_tokens(PROMPT)
    st = tier.stats()
    assert st["hit_rate"] == 1.0 and st["host_bytes"] == 0 and st["host_bytes_per_token"] == 0


def test_first_routed_fills_layer_by_layer_and_per_layer_spreads():
    """R4.2g in miniature: one global counter hands the first layers every slot."""
    c = tiny_moe().config
    rows = {}
    for policy in ("first-routed", "per-layer-first-routed"):
        m = tiny_moe()
        tier = ExpertTier(m, slots=c.num_experts // 2, admission=policy)
        m.forward_tokens(PROMPT)
        per_layer = (tier.cache.table != NOT_RESIDENT).sum(axis=1)
        rows[policy] = per_layer.tolist()
    assert rows["first-routed"][-1] == 0 and rows["first-routed"][0] > 0
    q = (c.num_experts // 2) // c.num_hidden_layers
    assert rows["per-layer-first-routed"][:-1] == [q] * (c.num_hidden_layers - 1)


def test_trace_recorded_while_running(tmp_path):
    from hpc_cli.model.expert_profile import read_trace

    m = tiny_moe()
    tier = ExpertTier(m, offload=False, trace_file=tmp_path / "t.bin")
    ref = tiny_moe().forward_tokens(PROMPT)
    torch.testing.assert_close(m.forward_tokens(PROMPT), ref)  # recording does not change the result
    _decode_logits(m, PROMPT[:5], steps=3)
    tier.close()
    tr = read_trace(tmp_path / "t.bin")
    assert tr.tokens == len(PROMPT) + 5 + 3
    assert (tr.n_layers, tr.n_expert, tr.top_k) == (m.config.num_hidden_layers, m.config.num_experts,
                                                    m.config.num_experts_per_tok)
    # the recorded routing is the router's
    x = torch.randn(3, m.config.hidden_size)
    _, idx = m.layers[0].mlp.route(x)
    assert idx.shape == (3, m.config.num_experts_per_tok)
