"""Byte accounting (spec §3.1-3.2), the rollback, acceptance statistics, sampled acceptance,
drafter checkpoints and settings."""

from __future__ import annotations

import collections

import pytest
import torch

from hpc_cli import plugins
from hpc_cli.engine.api import SamplingParams
from hpc_cli.memory.bundle import BundleLayout, round_up
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.shapes import preset

from helpers import backend, make, run, settle, tokens

MiB = 1 << 20
S27 = preset("qwen3.5-27b")


class _ShapeOnly:
    def shape(self):
        return S27


@pytest.mark.parametrize("profile,page_mib", [("bf16", 4.0), ("int8-g64", 2.0625)])
def test_mtp_adds_one_sixteenth_of_pages(profile, page_mib):
    prof = plugins.kv_profile(profile)
    mtp = plugins.spec_backend("mtp")
    a = S27.num_attention_layers
    base = PagedKVStorage(prof, a, S27.num_kv_heads, S27.head_dim, 1)
    with_mtp = PagedKVStorage(prof, a + mtp.extra_main_kv_layers, S27.num_kv_heads, S27.head_dim, 1)
    assert base.page_bytes == page_mib * MiB
    assert with_mtp.page_bytes * 16 == base.page_bytes * 17  # +1/16 for 27B
    assert BundleLayout.for_storage(with_mtp).record_bytes == with_mtp.page_bytes


def test_dflash_pool_joins_the_bundle():
    d = plugins.spec_backend("dflash")
    spec = d.backend_pool(S27)
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (5, 4, 256)
    main = PagedKVStorage(plugins.kv_profile("int8-g64"), 16, 4, 256, 1)
    own = PagedKVStorage(plugins.kv_profile("bf16"), spec.layers, spec.kv_heads, spec.head_dim, 1, name="dflash")
    assert own.page_bytes == spec.bytes_per_token() * 64 == int(1.25 * MiB)
    lay = BundleLayout.for_storage(main, own)
    assert lay.record_bytes == round_up(main.page_bytes) + own.page_bytes


def test_dflash2_image_is_195897344_bytes():
    d2 = plugins.spec_backend("dflash2")
    parts = d2.state_extra_parts(_ShapeOnly())
    (shape, dtype), = parts.values()
    assert shape == (5, 2, 2048, 8, 128) and dtype == torch.bfloat16
    assert d2.state_image_extra_bytes(S27) == 40 * MiB
    assert S27.state_image_bytes(d2.state_image_extra_bytes(S27)) == 195_897_344
    slots = StateSlots(S27.num_gdn_layers, S27.conv_dim, 3, S27.linear_num_value_heads, 128, 128, S27.hidden_size, 1,
                       dtype=torch.bfloat16, extra_parts=parts)
    assert slots.image_bytes == 195_897_344


def test_engine_pools_for_each_backend(model):
    a = len(model.config.attention_layers)
    for name, layers, own, extra in [("mtp", a + 1, False, 0), ("dflash", a, True, 0), ("dflash2", a, False, 1)]:
        e = make(model, name)
        assert e.storage.num_layers == layers
        assert (e.backend_storage is not None) == own
        assert len(e.states.extra) == extra
        assert e.cache.layout.record_bytes == BundleLayout.for_storage(e.storage, e.backend_storage).record_bytes
        if extra:
            assert e.states.image_bytes == model.shape().state_image_bytes(
                plugins.spec_backend(name).state_image_extra_bytes(model.shape()))
        settle(e)


def test_per_token_commit_equals_decode(model):
    """The state kept after column j of a verify pass equals j+1 one-token decodes."""
    from hpc_cli.speculative.ops import commit_states, verify_pass

    toks = tokens(70, 1)
    kv = model.new_kv_storage("bf16", 4)
    st = model.new_state_slots(2)
    for s in (0, 1):
        model.prefill(toks, 0, [0, 1] if s == 0 else [2, 3], s, kv, st)
    cont = [11, 22, 33, 44]
    out = verify_pass(model, torch.tensor([cont]), [70], [[0, 1]], [0], kv, st, keep_all=True)
    commit_states(st, out, [0], [2])
    for i, t in enumerate(cont[:3]):
        logits = model.decode([t], [70 + i], [[2, 3]], [1], kv, st)
        assert torch.allclose(logits[0], out.logits[0, i], atol=1e-4)
    for g in range(len(st.conv)):
        assert torch.allclose(st.conv[g][0], st.conv[g][1], atol=1e-6)
        assert torch.allclose(st.recurrent[g][0], st.recurrent[g][1], atol=1e-5)
    assert torch.allclose(st.hidden[0], st.hidden[1], atol=1e-5)


def test_acceptance_statistics_in_usage_and_stats(model):
    p = tokens(90, 5)
    off = make(model, reuse=False)
    ref = run(off, p, 30)[0]
    settle(off)
    e = make(model, backend("oracle", {tuple(p): ref}), num_draft_tokens=4)
    toks, fin = run(e, p, 30)
    assert toks == ref
    u = fin.usage
    # 29 tokens after the first: rounds of 5 (4 drafts + bonus), the last rounds shorter
    assert u.accepted_draft_tokens == u.draft_tokens > 0, u
    e._take_stats()
    st = e.stats().speculative
    assert st.backend == "oracle" and st.k == 4
    assert st.accepted_draft_tokens == u.accepted_draft_tokens
    assert st.mean_acceptance_length > 4.0, st
    assert e.stats().counters["generated_tokens"] == 30
    settle(e)
    e = make(model, "mtp")
    _, fin = run(e, p, 20)
    e._take_stats()
    st = e.stats().speculative
    assert st.draft_tokens == fin.usage.draft_tokens and 1.0 <= st.mean_acceptance_length <= 4.0
    settle(e)


def test_sampled_acceptance_keeps_the_target_distribution():
    """Rejection sampling against a point-mass draft: the first emitted token is distributed as p."""
    from hpc_cli.speculative.runtime import SpecRuntime

    logits = torch.randn(16) * 1.5
    sp = SamplingParams(max_tokens=5, temperature=0.7, top_k=10)
    from hpc_cli.engine.sampling import target_probs

    p = target_probs(logits, sp)
    draft = int(torch.argsort(p, descending=True)[1])

    class Lane:
        request = type("R", (), {"sampling": sp})()
        finish_reason = None
        generator = torch.Generator().manual_seed(3)

    class Eng:
        def __init__(self):
            self.first = None

        def emit(self, lane, ev):
            if self.first is None:
                self.first = ev.token_id

    rt = SpecRuntime.__new__(SpecRuntime)
    counts = collections.Counter()
    n = 6000
    lane = Lane()
    for _ in range(n):
        eng = Eng()
        rt._accept(eng, lane, torch.stack([logits, logits]), [draft])
        counts[eng.first] += 1
    emp = torch.tensor([counts[i] / n for i in range(16)])
    assert float((emp - p).abs().sum()) / 2 < 0.04, (emp, p)


def test_sampled_requests_run_with_speculation(model):
    e = make(model, "dflash2")
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a, _ = run(e, tokens(80, 3), sampling=sp)
    b, _ = run(e, tokens(80, 3), sampling=sp)
    assert len(a) == 20 and all(0 <= t < model.config.vocab_size for t in a)
    assert a == b  # seeded: reproducible
    settle(e)


def test_drafter_checkpoint_round_trip(model, tmp_path):
    from hpc_cli.speculative.dflash import save_drafter

    seeded = make(model, "dflash2")
    save_drafter(seeded.spec.drafter.net, str(tmp_path / "d2"))
    p = tokens(100, 12)
    a, fa = run(seeded, p, 16)
    settle(seeded)
    loaded = make(model, "dflash2", drafter=str(tmp_path / "d2"))
    b, fb = run(loaded, p, 16)
    settle(loaded)
    assert a == b and fa.usage.accepted_draft_tokens == fb.usage.accepted_draft_tokens
    from hpc_cli.errors import ConfigError

    with pytest.raises(ConfigError):
        make(model, "dflash", drafter=str(tmp_path / "d2"))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_deeper_drafter_checkpoint_gets_a_pool_and_rings_of_its_depth(model, kind, tmp_path):
    """A drafter checkpoint with more layers than the backend's default for the model's shape is
    served: its own pool (DFlash) or its rings in the state image (DFlash2) are sized after it,
    and greedy output stays the output without speculation."""
    from hpc_cli.speculative.dflash import RING_PART, DFlashNet, default_config, save_drafter, seed_weights

    default = plugins.spec_backend(kind)
    layers = (default.backend_pool(model.shape()).layers if kind == "dflash"
              else default.ring_geometry(model.shape())[0]) + 1
    net = DFlashNet(default_config(kind, model, layers, **({"window": 64} if kind == "dflash2" else {})),
                    dtype=torch.float32)
    seed_weights(net, 3)
    save_drafter(net, str(tmp_path / kind))
    p = tokens(90, 5)
    plain = make(model)
    ref, _ = run(plain, p, 12)
    settle(plain)
    e = make(model, kind, drafter=str(tmp_path / kind))
    got, fin = run(e, p, 12)
    if kind == "dflash":
        assert e.backend_storage.num_layers == layers
    else:
        assert tuple(e.states.extra[RING_PART].shape[1:]) == (layers, 2, 64, net.cfg.num_kv_heads, net.cfg.head_dim)
    settle(e)
    assert got == ref and fin.usage.draft_tokens > 0


def test_from_settings_builds_the_backend():
    from hpc_cli.engine.engine import Engine
    from hpc_cli.settings import load_settings

    r = load_settings(None, {"speculative.backend": "mtp", "speculative.num_draft_tokens": 2,
                             "engine.kv_capacity": 32, "engine.max_concurrency": 1, "model.name": "builtin:random"},
                      environ={})
    e = Engine.from_settings(r).start()
    assert e.spec is not None and e.spec.name == "mtp" and e.spec.k == 2
    toks, fin = run(e, tokens(60, 1), 6)
    assert fin.usage.draft_tokens > 0
    settle(e)
