"""The zero-split GDN tap on the CPU (spec §7.2-7.3, qualified as §13.2 asks): a pass returns the
recurrent state and the conv window at any list of positions, with no second pass."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model.gdn import chunk_rule, recurrent_rule
from hpc_cli.model.gdn_taps import tapped_rule

from .helpers import rel_err, rule_inputs

B, HK, HV, D = 1, 2, 4, 16  # small heads: the sweep covers every phase and length


def _inputs(t: int, seed: int, hk: int = HK, hv: int = HV, d: int = D, dtype=torch.float32):
    return rule_inputs(seed, B, t, hk, hv, d, dtype, decay_scale=0.5, state_scale=0.1)


def _cut(xs, n):
    return [x[:, :n] for x in xs[:5]] + [xs[5]]


def _oracle_states(xs, taps):
    """fp64 naive recurrence, the state after each tap."""
    q, k, v, g, beta, s0 = (x.double() for x in xs)
    out = []
    state = s0
    at = 0
    for p in taps:
        _, state = recurrent_rule(q[:, at:p], k[:, at:p], v[:, at:p], g[:, at:p], beta[:, at:p], state)
        out.append(state)
        at = p
    return out


@pytest.mark.parametrize("t", [1, 63, 64, 65, 2048, 4096])
def test_every_phase_against_the_fp64_oracle_and_truncated_calls(t):
    """Taps at every phase 0..63 (offsets p with p % 64 = phase): each within fp32 rounding of the
    fp64 naive recurrence, and bit-identical to this function's final state on the rows up to it
    with the same earlier taps (a truncated call on the same grid)."""
    xs = _inputs(t, seed=t)
    phases = range(64) if t >= 128 else range(1, t)
    taps = sorted({min(t - 1, 64 * (i % max(1, t // 64)) + ph) for i, ph in enumerate(phases)} - {0})
    out, final, states = tapped_rule(*xs, taps)
    assert len(states) == len(taps)
    for p, s, ref in zip(taps, states, _oracle_states(xs, taps)):
        assert rel_err(s.double(), ref) < 2e-5, f"tap {p}"
    for j in range(0, len(taps), max(1, len(taps) // 8)):  # truncated calls (a sample: each is a whole call)
        p = taps[j]
        _, trunc, _ = tapped_rule(*_cut(xs, p), taps[:j])
        assert torch.equal(trunc, states[j]), f"tap {p} differs from the truncated call"
    ref_out, ref_final = recurrent_rule(*(x.double() for x in xs))
    assert rel_err(out.double(), ref_out) < 2e-5 and rel_err(final.double(), ref_final) < 2e-5


def test_no_taps_and_phase_zero_taps_are_the_plain_rule():
    """Without taps, and with taps on the chunk grid (phase 0): outputs and final state equal
    chunk_rule's bit for bit, and each tap is the state the plain call passes there."""
    xs = _inputs(300, seed=1)
    out, final = chunk_rule(*xs)
    o0, f0, _ = tapped_rule(*xs, [])
    o1, f1, states = tapped_rule(*xs, [64, 192, 256])
    assert torch.equal(o0, out) and torch.equal(f0, final)
    assert torch.equal(o1, out) and torch.equal(f1, final)
    for p, s in zip([64, 192, 256], states):
        assert torch.equal(s, chunk_rule(*_cut(xs, p))[1]), f"phase-0 tap {p}"


def test_taps_change_no_number_and_equal_truncated_calls():
    """One call with taps off the grid computes the call without taps, bit for bit (the grid
    stays where it is: the tap costs no extra pass and changes no number), and each tap is the
    final state of the plain rule on the rows up to it, bit for bit; a pass split at the taps
    (a new grid at each) agrees to fp32 rounding."""
    xs = _inputs(500, seed=2)
    taps = [37, 101, 333, 499]
    out, final, states = tapped_rule(*xs, taps)
    ref_out, ref_final = chunk_rule(*xs)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    for p, s in zip(taps, states):
        assert torch.equal(s, chunk_rule(*_cut(xs, p))[1]), f"tap {p}"
    q, k, v, g, beta, s0 = xs
    state, outs = s0, []
    for a, b in zip([0, *taps], [*taps, 500]):
        o, state = chunk_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state)
        outs.append(o)
        if b < 500:
            assert rel_err(state, states[taps.index(b)]) < 1e-5, f"tap {b} against the split pass"
    assert rel_err(torch.cat(outs, dim=1), out) < 1e-5 and rel_err(state, final) < 1e-5


def test_real_widths():
    """The 27B mixer widths (16 key / 48 value heads of 128): taps against the fp64 oracle."""
    xs = _inputs(200, seed=3, hk=16, hv=48, d=128)
    taps = [1, 63, 64, 129, 199]
    _, _, states = tapped_rule(*xs, taps)
    for p, s, ref in zip(taps, states, _oracle_states(xs, taps)):
        assert rel_err(s.double(), ref) < 2e-5, f"tap {p}"


def test_head_groups_on_the_cpu_change_no_bit(monkeypatch):
    """On the CPU the chunk rule runs over groups of heads (``CPU_GROUP_STATE_BYTES``); with the
    27B mixer widths (6 groups of at most 3 key heads here) the output, the final state and every
    tap equal one call over all heads bit for bit, and the groups are really taken."""
    from hpc_cli.model import gdn

    xs = _inputs(300, seed=4, hk=16, hv=48, d=128)
    taps = [1, 64, 130, 300]
    calls = []
    inner = gdn._chunk_states
    monkeypatch.setattr(gdn, "_chunk_states", lambda *a: calls.append(a[1].shape[2]) or inner(*a))
    monkeypatch.setattr(gdn, "CPU_GROUP_STATE_BYTES", 3 * 3 * 128 * 128 * 4)
    out, final, kept = gdn.chunk_states(*xs, 64, taps)
    assert calls == [3, 3, 3, 3, 3, 1], calls
    monkeypatch.setattr(gdn, "CPU_GROUP_STATE_BYTES", 1 << 40)
    calls.clear()
    ref_out, ref_final, ref_kept = gdn.chunk_states(*xs, 64, taps)
    assert calls == [16], calls
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    assert all(torch.equal(a, b) for a, b in zip(kept, ref_kept)) and len(kept) == len(taps)


def test_layer_taps_conv_windows_are_a_host_gather():
    """GatedDeltaNet.prefill_tapped: each tap's conv window is the pre-conv projected columns
    [p - 3, p) (from the previous conv state where p < 3), byte for byte; its state matches the
    layer's own pass over the first p tokens (within fp32 rounding: a projection over p rows may
    round differently from one over T rows, so the rule's inputs are not the same bits; the rule
    itself is bit-exact on the same inputs, tested above); the pass's outputs and end states match
    prefill's."""
    from hpc_cli.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)
    layer = next(l.linear_attn for l in model.layers if l.kind == "linear_attention")
    g = torch.Generator().manual_seed(4)
    t = 150
    x = torch.randn(t, model.config.hidden_size, generator=g)
    conv0 = torch.randn(layer.conv_dim, layer.kernel - 1, generator=g)
    rec0 = torch.randn(layer.n_v, layer.d_k, layer.d_v, generator=g) * 0.1
    taps = [1, 2, 3, 70, 128]
    out, conv, rec, tapped = layer.prefill_tapped(x, conv0, rec0, taps)
    ref_out, ref_conv, ref_rec = layer.prefill(x, conv0, rec0)
    assert rel_err(out, ref_out) < 1e-5 and torch.equal(conv, ref_conv) and rel_err(rec, ref_rec) < 1e-5
    mixed = layer.in_proj_qkv(x).transpose(0, 1)  # [C, T] pre-conv columns
    history = torch.cat([conv0, mixed], dim=-1)
    for p, (window, state) in zip(taps, tapped):
        assert torch.equal(window, history[:, p:p + layer.kernel - 1]), f"conv window at tap {p}"
        _, _, trunc, _ = layer.prefill_tapped(x[:p], conv0, rec0, [q for q in taps if q < p])
        assert rel_err(state, trunc) < 1e-5, f"state at tap {p}"
