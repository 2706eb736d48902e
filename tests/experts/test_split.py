"""The split MoE (resident from slots + misses from the host copy) equals the all-resident MoE."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpc_cli.model.expert_profile import build_profile, synthetic_trace, trace_counts
from hpc_cli.experts.cache import NOT_RESIDENT
from hpc_cli.experts.hook import expert_stats
from hpc_cli.experts.tier import POLICIES, ExpertTier

from .helpers import check_layer_equals_plain_experts, tiny_moe

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


@pytest.mark.parametrize("path", ["gather", "loop"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_split_equals_all_resident(policy, fraction, path, reference):
    ref_prefill, ref_decode = reference
    m = tiny_moe()
    c = m.config
    slots = int(fraction * c.num_hidden_layers * c.num_experts)
    tier = ExpertTier(m, slots=slots, admission=policy, profile=_profile(m, slots), verify=True)
    if path == "loop":  # every batch takes the per-expert loop (prefill-sized batches do)
        tier.gather_max_picks = 0
    assert all(layer.mlp.experts.gate_up_proj is None for layer in m.layers)  # the device copy is gone
    for _ in range(2):  # the second pass runs on what the first-routed policies admitted
        torch.testing.assert_close(m.forward_tokens(PROMPT), ref_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_decode_logits(m, PROMPT), ref_decode, rtol=1e-4, atol=1e-4)
    st = expert_stats(m)
    assert st.slots == slots and st.resident <= slots
    if slots == 0:
        assert st.hit_rate == 0.0
        assert st.host_bytes_per_token > 0
    if fraction == 1.0:
        assert st.resident > 0 and st.hit_rate > 0
        if policy == "profile":  # every ranked pair admitted before the first token
            assert st.resident == _profile(m, slots).n_ranked
    assert len(st.hit_rate_per_layer) == c.num_hidden_layers
    tier.verify_all()


def test_all_slots_resident_reads_nothing_from_host():
    m = tiny_moe()
    c = m.config
    n = c.num_hidden_layers * c.num_experts
    tier = ExpertTier(m, slots=n, admission="per-layer-first-routed")
    # admit everything up front: then no token misses
    for layer in range(c.num_hidden_layers):
        for e in range(c.num_experts):
            assert tier.admit_blocking(layer, e) != NOT_RESIDENT
    tier.verify_all()
    m.forward_tokens(PROMPT)
    st = tier.stats()
    assert st.hit_rate == 1.0 and st.host_bytes == 0 and st.host_bytes_per_token == 0


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


# -- the resident path stays on the device ----------------------------------------------------------
_SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
                "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"}


class _NoHostRead(TorchDispatchMode):
    """Ops that read a tensor's values to the host (``.item()``, ``bool()``, ``nonzero``, ``unique``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _SYNCING_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _guard_routed(tier, monkeypatch):
    """Run ``tier.routed`` under :class:`_NoHostRead` with ``Tensor.cpu/tolist/item/numpy`` refused
    (only inside it: the rest of the model may use them)."""
    inside = [False]
    mode = _NoHostRead()
    for name in ("cpu", "tolist", "item", "numpy"):
        orig = getattr(torch.Tensor, name)

        def refuse(self, *a, _orig=orig, _name=name, **kw):
            if inside[0]:
                raise AssertionError(f"Tensor.{_name}() on the resident path")
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, refuse)
    routed = tier.routed

    def guarded(*a, **kw):
        inside[0] = True
        try:
            with mode:
                return routed(*a, **kw)
        finally:
            inside[0] = False
    monkeypatch.setattr(tier, "routed", guarded)
    return mode


def _all_resident_tier(m):
    c = m.config
    n = c.num_hidden_layers * c.num_experts
    return ExpertTier(m, slots=n, admission="profile", profile=_profile(m, n))


@pytest.mark.parametrize("chunked", [False, True])
def test_all_resident_path_never_reads_the_device(reference, monkeypatch, chunked):
    """100% of the pairs resident: no read from the device, no miss path, no loop over experts;
    hits counted from the shapes."""
    ref_prefill, ref_decode = reference
    m = tiny_moe()
    c = m.config
    tier = _all_resident_tier(m)
    if chunked:
        tier.gather_max_bytes = 1
    assert (tier._live_count == c.num_experts).all()
    assert tier.residency.dtype == torch.int32 and tuple(tier.residency.shape) == (c.num_hidden_layers,
                                                                                   c.num_experts)
    mode = _guard_routed(tier, monkeypatch)
    torch.testing.assert_close(m.forward_tokens(PROMPT), ref_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_decode_logits(m, PROMPT), ref_decode, rtol=1e-4, atol=1e-4)
    assert mode.seen == []
    st = tier.stats()
    assert st.syncs == 0 and st.miss_calls == 0
    assert st.hit_rate == 1.0 and st.hit_rate_per_layer == [1.0] * c.num_hidden_layers
    assert st.host_bytes == 0 and st.host_bytes_per_token == 0
    picks = (len(PROMPT) + len(PROMPT) + 4) * c.num_experts_per_tok  # forward_tokens, prefill, 4 decode steps
    assert tier.hits.tolist() == [picks] * c.num_hidden_layers and tier.misses.sum() == 0


def test_the_guard_sees_the_miss_path(monkeypatch):
    """The guard above is not vacuous: a tier with misses trips it."""
    m = tiny_moe()
    ExpertTier(m, slots=0, admission="per-layer-first-routed")
    _guard_routed(m.expert_tier, monkeypatch)
    with pytest.raises(AssertionError, match="resident path"):
        m.forward_tokens(PROMPT)


def test_only_layers_with_non_resident_experts_read():
    """Layer 0 fully resident, the others partly: one read per call of each partial layer, none
    for layer 0; stats per layer add up to the picks."""
    m = tiny_moe()
    c = m.config
    L, E, k = c.num_hidden_layers, c.num_experts, c.num_experts_per_tok
    tier = ExpertTier(m, slots=E + (L - 1) * 2, admission="first-routed")
    for e in range(E):
        tier.admit_blocking(0, e)
    for layer in range(1, L):
        for e in range(2):
            tier.admit_blocking(layer, e)
    ref = tiny_moe().forward_tokens(PROMPT)
    torch.testing.assert_close(m.forward_tokens(PROMPT), ref, rtol=1e-4, atol=1e-4)
    assert tier.syncs == L - 1  # one forward: every layer but the first read once
    assert tier.hits[0] == len(PROMPT) * k and tier.misses[0] == 0
    assert ((tier.hits + tier.misses) == len(PROMPT) * k).all()
    assert tier.miss_calls == L - 1
    st = tier.stats()
    assert st.hit_rate_per_layer[0] == 1.0 and all(h < 1.0 for h in st.hit_rate_per_layer[1:])
    assert st.host_bytes > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident", [0, 5, 16])
@pytest.mark.parametrize("path", ["gather", "chunked", "loop"])
def test_layer_equals_plain_experts(dtype, resident, path):
    """One layer call against the plain fused experts of the same weights, at a decode and a
    prefill batch, with 0, some and all of the layer's experts resident."""
    m = tiny_moe().to(dtype)
    check_layer_equals_plain_experts(m, path, resident, 1e-5 if dtype == torch.float32 else 2e-2)
