"""Chunked prefill at arbitrary splits, resume from a copied state image, decode after prefill."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model import HybridModel

from .helpers import F32, rel_err, rule_inputs

BOUND = 2e-5  # fp32 rounding: split runs sum in another order
N = 200


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 272, (N + 16,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def full(tiny, tokens):
    return tiny.forward_tokens(tokens, kv_profile=F32)


def _pools(model, pages=8, slots=4):
    return model.new_kv_storage(F32, pages), model.new_state_slots(slots)


# a shuffled block table: pages need not be consecutive or ordered
TABLE = [5, 2, 7, 0, 3, 6, 1, 4]


@pytest.mark.parametrize("cuts", [[1], [63], [64], [65], [1, 64, 129], [37, 74, 111, 148, 185], [63, 65, 127]],
                         ids=lambda c: "-".join(map(str, c)))
def test_split_prefill_equals_unsplit(tiny, tokens, full, cuts):
    kv, states = _pools(tiny)
    bounds = [0, *cuts, N]
    for a, b in zip(bounds, bounds[1:]):
        out = tiny.prefill(tokens[a:b], a, TABLE, 1, kv, states, all_logits=True)
        err = rel_err(out.logits, full[a:b])
        assert err <= BOUND, f"chunk [{a}, {b}) differs from the unsplit pass by {err:.2e}"
    ref_kv, ref_states = _pools(tiny)
    last = tiny.prefill(tokens[:N], 0, TABLE, 1, ref_kv, ref_states)
    for g in range(len(states.recurrent)):
        assert rel_err(states.recurrent[g][1], ref_states.recurrent[g][1]) <= BOUND
        assert rel_err(states.conv[g][1], ref_states.conv[g][1]) <= BOUND
    assert rel_err(states.hidden[1], last.hidden_last) <= BOUND


def test_resume_from_copied_state_slot(tiny, tokens, full):
    kv, states = _pools(tiny)
    tiny.prefill(tokens[:100], 0, TABLE, 0, kv, states)
    states.copy_slot(0, 3)          # a snapshot of the image at position 100
    states.reset(0)                 # the original lane is gone
    # a new lane forks the pages (copy every page, here the shared prefix into fresh ids)
    table2 = [6, 1, 4, 5]
    for src, dst in zip(TABLE[:2], table2[:2]):
        kv.copy_page(src, dst)
    out = tiny.prefill(tokens[100:N], 100, table2, 3, kv, states, all_logits=True)
    err = rel_err(out.logits, full[100:N])
    assert err <= BOUND, f"resumed prefill differs from the unsplit pass by {err:.2e}"


def test_layer_ready_called_before_each_layer_in_order(tiny, tokens):
    kv, states = _pools(tiny)
    seen = []
    tiny.prefill(tokens[:10], 0, TABLE, 0, kv, states, layer_ready=seen.append)
    assert seen == list(range(tiny.config.num_hidden_layers))


def test_decode_after_prefill_equals_full_forward(tiny, tokens, full):
    kv, states = _pools(tiny)
    start = 120
    tiny.prefill(tokens[:start], 0, TABLE, 2, kv, states)
    for p in range(start, start + 16):
        logits = tiny.decode(tokens[p:p + 1], [p], [TABLE], [2], kv, states)
        ref = full[p] if p < N else tiny.forward_tokens(tokens[:p + 1], kv_profile=F32)[-1]
        err = rel_err(logits[0], ref)
        assert err <= BOUND, f"decode at position {p} differs from the full forward by {err:.2e}"


def test_batched_decode_equals_single_lanes(tiny, tokens):
    lengths = [5, 64, 130]
    tables = [[0], [3, 4], [6, 7, 5]]
    kv, states = _pools(tiny)
    for lane, (n, bt) in enumerate(zip(lengths, tables)):
        tiny.prefill(tokens[:n], 0, bt, lane, kv, states)
    nxt = tokens[[n for n in lengths]]
    batched = tiny.decode(nxt, lengths, tables, [0, 1, 2], kv, states)
    for lane, n in enumerate(lengths):
        ref = tiny.forward_tokens(tokens[:n + 1], kv_profile=F32)[-1]
        err = rel_err(batched[lane], ref)
        assert err <= BOUND, f"lane {lane} (length {n}) differs in a batch by {err:.2e}"


def test_gdn_chunk_rule_matches_recurrent_rule():
    from hpc_cli.model.gdn import chunk_rule, recurrent_rule

    q, k, v, decay, beta, s0 = rule_inputs(0, b=2, t=70, hk=2, hv=4, d=16)
    o1, s1 = chunk_rule(q, k, v, decay, beta, s0)
    o2, s2 = recurrent_rule(q, k, v, decay, beta, s0)
    assert rel_err(o1, o2) < 1e-5 and rel_err(s1, s2) < 1e-5


def test_recurrent_rule_steps_the_delta_rule_and_leaves_the_initial_state_alone():
    """The decode form (in-place state, batched matrix products) against the gated delta rule
    written out token by token in fp64: S <- a S; S <- S + beta k (v - S^T k)^T; o = S^T q."""
    from hpc_cli.model.gdn import recurrent_rule

    t, hk, hv, d = 5, 2, 6, 16
    q, k, v, decay, beta, s0 = rule_inputs(1, b=2, t=t, hk=hk, hv=hv, d=d)
    kept = s0.clone()
    out, state = recurrent_rule(q, k, v, decay, beta, s0)
    assert torch.equal(s0, kept), "the caller's initial state was written"
    rep = hv // hk
    S = s0.double().clone()
    for i in range(t):
        for h in range(hv):
            qi = q[:, i, h // rep].double()
            ki = k[:, i, h // rep].double()
            qi = qi / qi.norm(dim=-1, keepdim=True) * d ** -0.5
            ki = ki / ki.norm(dim=-1, keepdim=True)
            Sh = S[:, h] * decay[:, i, h].double().exp()[:, None, None]
            delta = (v[:, i, h].double() - torch.einsum("bkv,bk->bv", Sh, ki)) * beta[:, i, h].double()[:, None]
            S[:, h] = Sh + ki[:, :, None] * delta[:, None, :]
            ref = torch.einsum("bkv,bk->bv", S[:, h], qi)
            assert rel_err(out[:, i, h].double(), ref) < 1e-5, (i, h)
    assert rel_err(state.double(), S) < 1e-5
    strided = s0.transpose(0, 1).contiguous().transpose(0, 1)  # the same state, another layout
    again, state_again = recurrent_rule(q, k, v, decay, beta, strided)
    assert torch.equal(again, out) and torch.equal(state_again, state)


@pytest.mark.parametrize("cuts", [[1], [37, 101], [64, 128]], ids=lambda c: "-".join(map(str, c)))
def test_padded_prefill_equals_unpadded(tiny, tokens, cuts):
    """Passes padded at their end (what CUDA does, so kernels meet few lengths) leave the same K/V,
    the same GDN states and the same logits as unpadded passes: padded rows decay nothing, write
    nothing and are dropped."""
    runs = {}
    for pad in (1, 64):
        kv, states = _pools(tiny)
        tiny.prefill_pad = pad
        try:
            bounds = [0, *cuts, N]
            logits = [tiny.prefill(tokens[a:b], a, TABLE, 1, kv, states, all_logits=True).logits
                      for a, b in zip(bounds, bounds[1:])]
        finally:
            tiny.prefill_pad = 1
        runs[pad] = (torch.cat(logits), kv, states)
    (l1, kv1, s1), (l64, kv64, s64) = runs[1], runs[64]
    assert l64.shape == l1.shape, f"padded pass returned {tuple(l64.shape)} logits, expected {tuple(l1.shape)}"
    assert rel_err(l64, l1) <= BOUND
    for g in range(len(s1.recurrent)):
        assert rel_err(s64.recurrent[g][1], s1.recurrent[g][1]) <= BOUND, f"GDN layer {g} state"
        assert rel_err(s64.conv[g][1], s1.conv[g][1]) <= BOUND, f"GDN layer {g} conv window"
    assert rel_err(s64.hidden[1], s1.hidden[1]) <= BOUND
    k1, v1 = kv1.gather(0, TABLE, N, torch.float32)
    k64, v64 = kv64.gather(0, TABLE, N, torch.float32)
    assert rel_err(k64, k1) <= BOUND and rel_err(v64, v1) <= BOUND
    # nothing was written past the prompt: the pages' remaining slots are still zero
    tail_k, _ = kv64.gather(0, TABLE, len(TABLE) * 64, torch.float32)
    assert not tail_k[N:].any(), "a padded row wrote K/V into the pages"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 64, 517])
def test_cpu_time_major_conv_matches_grouped_conv1d(dtype, t):
    """The CPU's causal conv (k multiply-adds over [T, C] slices) gives the grouped conv1d's
    numbers: the same sums in the same order in fp32, accumulated in fp32 and rounded once for
    bf16 (conv1d's result, and the exactly rounded sum, for these inputs)."""
    import torch.nn.functional as F

    from hpc_cli.model.gdn import causal_conv_time_major

    g = torch.Generator().manual_seed(t)
    c = 96
    w = torch.randn(c, 1, 4, generator=g).to(dtype)
    state, mixed = torch.randn(c, 3, generator=g).to(dtype), torch.randn(t, c, generator=g).to(dtype)
    window = torch.cat([state, mixed.t()], dim=-1)
    ref = F.conv1d(window.unsqueeze(0), w, groups=c)[0]
    got = causal_conv_time_major(window.t(), w).t()
    assert got.dtype == dtype
    exact = F.conv1d(window.unsqueeze(0).double(), w.double(), groups=c)[0].to(dtype)
    assert torch.allclose(got.double(), ref.double(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, exact), "bf16 is accumulated in fp32 and rounded once"
