"""bf16: the verify pass computes every column bit-identically to one-token decode, so greedy
output with each backend is token for token the output without speculation and the oracle
drafter is always accepted (docs/speculative.md, "Bit-identical verify")."""

from __future__ import annotations

import random

import pytest
import torch

from hpc_cli.engine.api import GenerationRequest
from hpc_cli.model.builtin import init_seeded, tiny_config
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.model import HybridModel
from hpc_cli.speculative.ops import commit_states, verify_pass

from helpers import BACKENDS, backend, greedy, make, run, settle, tokens

P = [tokens(150, 11), tokens(70, 12), tokens(200, 13), tokens(90, 14)]
N = 24


def wide_config() -> ModelConfig:
    """The 27B's attention and GDN head shapes (24 x 256 query heads, 4 KV heads, 16/48 x 128 GDN
    heads) on a narrow residual stream: the shapes where bf16 verify first diverged from decode."""
    d = tiny_config().to_dict()
    d.update(name="bf16-wide", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             layer_types=[], num_attention_heads=24, num_key_value_heads=4, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
             linear_value_head_dim=128)
    return ModelConfig(**d)


@pytest.fixture(scope="module")
def bf16_model():
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def wide_model():
    m = HybridModel(wide_config(), dtype=torch.bfloat16, with_mtp=False)
    init_seeded(m)
    return m.eval()


def check_columns(m, B: int, T: int, seed: int, device="cpu") -> None:
    """Decode ``T`` tokens one by one for ``B`` lanes, then verify the same tokens from the same
    state in one pass: logits, hidden and every state byte must be equal, for both rollbacks."""
    rng = random.Random(seed)
    page = 64
    kv = m.new_kv_storage("bf16", 8 * B)
    st = m.new_state_slots(B)
    tables = [list(range(b * 8, b * 8 + 8)) for b in range(B)]
    starts = [rng.randrange(20, 200) for _ in range(B)]
    starts[0] = page - 2  # the columns cross a page boundary (the key span widens mid-pass)
    for b in range(B):
        m.prefill([rng.randrange(1, 250) for _ in range(starts[b])], 0, tables[b], b, kv, st)
    toks = torch.tensor([[rng.randrange(1, 250) for _ in range(T)] for _ in range(B)])
    parts = (st.conv_all, st.recurrent_all, st.hidden)
    before = [p.clone() for p in parts]
    dec, conv, rec, hid = [], [], [], []
    for t in range(T):
        dec.append(m.decode(toks[:, t], [s + t for s in starts], tables, list(range(B)), kv, st))
        conv.append(st.conv_all.clone())
        rec.append(st.recurrent_all.clone())
        hid.append(st.hidden.clone())
    dec = torch.stack(dec, 1)
    for keep_all in (True, False):
        for p, s in zip(parts, before):
            p.copy_(s)
        out = verify_pass(m, toks, starts, tables, list(range(B)), kv, st, keep_all=keep_all)
        assert torch.equal(out.logits, dec), (keep_all, (out.logits.float() - dec.float()).abs().amax(-1))
        assert torch.equal(out.hidden[:, -1], st.hidden if not keep_all else hid[-1])
        if keep_all:
            for j in range(T):  # the rollback to every column restores decode's state exactly
                commit_states(st, out, list(range(B)), [j] * B)
                assert torch.equal(st.conv_all, conv[j]) and torch.equal(st.recurrent_all, rec[j]), j
                assert torch.equal(st.hidden, hid[j]), j
        else:
            assert torch.equal(st.conv_all, conv[-1]) and torch.equal(st.recurrent_all, rec[-1])


@pytest.mark.parametrize("B,T", [(1, 4), (2, 4), (3, 2)])
def test_verify_columns_bit_identical_tiny(bf16_model, B, T):
    check_columns(bf16_model, B, T, seed=B * 10 + T)


@pytest.mark.parametrize("B,T", [(1, 4), (2, 3)])
def test_verify_columns_bit_identical_wide(wide_model, B, T):
    check_columns(wide_model, B, T, seed=B * 10 + T)


def test_more_rows_than_a_block(bf16_model):
    """B*T above the row block: several fixed-size blocks, still bit-identical."""
    old = bf16_model.row_block
    bf16_model.row_block = 2
    try:
        check_columns(bf16_model, 3, 4, seed=7)
    finally:
        bf16_model.row_block = old


@pytest.fixture(scope="module")
def refs(bf16_model):
    off = make(bf16_model, reuse=False, kv_pages=32)
    out = {tuple(p): run(off, p, N)[0] for p in P}
    settle(off)
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_bf16_greedy_equals_plain(bf16_model, refs, name):
    e = make(bf16_model, backend(name, refs))
    handles = [e.submit(GenerationRequest(list(p), greedy(N))) for p in P]  # lanes verify together
    usage = []
    for p, h in zip(P, handles):
        toks, fin = h.result(timeout=300)
        assert fin.reason == "length", fin.error
        assert [t.token_id for t in toks] == refs[tuple(p)], (name, p[:4])
        usage.append(fin.usage)
    settle(e)
    if name == "oracle":
        assert all(u.draft_tokens > 0 and u.accepted_draft_tokens == u.draft_tokens for u in usage), usage
