"""The zero-split tap on CUDA (spec §13.2 qualification): fla's chunk kernels with the tap
recurrence (hpc_kernels.gdn_state_taps) in place of fla's state recurrence. With or without taps
the output and the final state are fla's own call's bit for bit; each tap equals a call truncated
at it (the same phase) bit for bit, and is within bf16 rounding of an fp64 token-by-token
recurrence. Then whole passes: a prefill graph with tap slots equals the eager tapped pass."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# the 27B widths: 16 key heads and 48 value heads of 128
HK, HV, D = 16, 48, 128


def _needs_fla():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hpc_cli.model.gdn_taps import fla_taps_supported

    if not fla_taps_supported(D):
        pytest.skip("needs fla's chunk kernels")


def _inputs(t: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, t, HK, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, t, HK, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, t, HV, D, device="cuda", generator=g).bfloat16()
    gate = -torch.rand(1, t, HV, device="cuda", generator=g) * 0.2
    beta = torch.rand(1, t, HV, device="cuda", generator=g).bfloat16()
    s0 = torch.randn(1, HV, D, D, device="cuda", generator=g) * 0.1
    return q, k, v, gate, beta, s0


def _cut(xs, a, b, pad: bool = False):
    """Rows ``[a, b)``; ``pad``: followed by identity rows (zeros) up to a multiple of 64, as the
    engine pads every CUDA pass (fla masks a partial last chunk, which rounds differently)."""
    rows = [x[:, a:b] for x in xs[:5]]
    n = (-(b - a)) % 64 if pad else 0
    return [torch.cat([x, x.new_zeros(1, n, *x.shape[2:])], dim=1) for x in rows] if n else rows


def _split(xs, taps):
    """The pass split at ``taps``, as the engine splits: fla's own call per run (padded to a
    multiple of 64), each from the last one's state."""
    from hpc_cli.model.gdn import gated_delta_prefill

    t = xs[0].shape[1]
    outs, states, state = [], [], xs[5]
    for a, b in zip([0, *taps], [*taps, t]):
        o, state = gated_delta_prefill(*_cut(xs, a, b, pad=True), state)
        outs.append(o[:, :b - a])
        states.append(state)
    return torch.cat(outs, dim=1), states


@pytest.mark.parametrize("t", [1, 63, 64, 65, 2048, 4096])
def test_no_tap_is_flas_own_call(t):
    """Phase 0: the tap rule is fla's chunk_gated_delta_rule bit for bit, with its four slots
    unused and with taps (a tap changes neither the output nor the final state)."""
    _needs_fla()
    from hpc_cli.model.gdn import gated_delta_prefill
    from hpc_cli.model.gdn_taps import fla_tap_rule

    xs = _inputs(t)
    ref_o, ref_s = gated_delta_prefill(*xs)
    for taps in ([0, 0, 0, 0], (sorted({1, t // 2, t - 1} - {0}) + [0] * 4)[:4]):
        # the taps' states in slots 0..3, the lane's state in slot 4: read and written in place
        states = torch.empty(5, HV, D, D, device="cuda")
        states[4] = xs[5][0]
        lane = torch.tensor([4], device="cuda")
        out = fla_tap_rule(*xs[:5], states, lane, torch.tensor(taps, device="cuda"), torch.arange(4, device="cuda"))
        assert torch.equal(out, ref_o) and torch.equal(states[4], ref_s[0]), f"taps {taps}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("t", [65, 2048, 4096])
def test_taps_equal_truncated_calls(t):
    """Taps at several phases: each tap state equals the final state of fla's own call on the
    rows up to the tap bit for bit (spec §7.3: a separate call ending at the tap, same phase);
    the output and final state equal fla's own call on the whole pass, and a pass split at the
    taps within bf16 rounding. This needs fla's q/k l2norm to run one launch configuration
    whatever the row count (the shipped configurations pin it). A call padded with identity rows
    to the chunk's end is not the same call: its last row's cumulative gate sums the zeros in
    another order, and its final state differed by ~2e-6 (relative) on an H200."""
    _needs_fla()
    from hpc_cli.model.gdn import gated_delta_prefill
    from hpc_cli.model.gdn_taps import tapped_rule

    xs = _inputs(t, seed=t)
    taps = sorted({1, 63, 64, t // 3, t // 2 + 17, t - 1} - {0, t})
    out, final, states = tapped_rule(*_cut(xs, 0, t, pad=True), xs[5], taps)
    out = out[:, :t]
    own_o, own_s = gated_delta_prefill(*_cut(xs, 0, t, pad=True), xs[5])
    assert torch.equal(out, own_o[:, :t]) and torch.equal(final, own_s), "the pass differs from fla's own call"
    ref_out, ref_states = _split(xs, taps)
    errors = {"output": _rel(out, ref_out), "final": _rel(final, ref_states[-1]),
              **{f"tap {p}": _rel(states[j], ref_states[j]) for j, p in enumerate(taps)}}
    print(f"T={t} against the split pass: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    for j, p in enumerate(taps):
        _, trunc = gated_delta_prefill(*_cut(xs, 0, p), xs[5])
        assert torch.equal(states[j], trunc), f"tap {p} differs from the truncated call: {_rel(states[j], trunc):.2e}"
    assert max(errors.values()) < 1e-2, errors


def _fp64_states(xs, t: int) -> dict[int, torch.Tensor]:
    """The naive recurrence in fp64, token by token: the state after every position."""
    q, k, v, gate, beta, s0 = (x.double() for x in xs)
    rep = HV // HK
    q, k = (x.repeat_interleave(rep, dim=2)[0] for x in (q, k))
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state, out = s0[0], {}
    for i in range(t):
        state = state * gate[0, i].exp()[:, None, None]
        delta = (v[0, i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[0, i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i + 1] = state
    return out


def test_every_phase_against_an_fp64_recurrence():
    """A tap at each phase 0..63 of a chunk: bit-identical to the truncated call, and within
    bf16 rounding of the fp64 recurrence (the same inputs, token by token)."""
    _needs_fla()
    from hpc_cli.model.gdn_taps import tapped_rule

    t = 192
    xs = _inputs(t, seed=5)
    ref = _fp64_states(xs, t)
    worst = 0.0
    for phase in range(64):
        p = 64 + phase
        _, _, states = tapped_rule(*_cut(xs, 0, t, pad=True), xs[5], [p])
        _, trunc, _ = tapped_rule(*_cut(xs, 0, p), xs[5], [])
        assert torch.equal(states[0], trunc), f"phase {phase}: tap differs from the truncated call"
        err = float((states[0][0].double() - ref[p]).norm() / ref[p].norm())
        worst = max(worst, err)
        assert err < 2e-2, f"phase {phase}: relative error {err:.2e} against the fp64 recurrence"
    print(f"worst relative error against the fp64 recurrence over 64 phases: {worst:.2e}")


@pytest.mark.parametrize("taps", [[5], [37, 101], [64, 128, 129, 250]], ids=lambda t: "-".join(map(str, t)))
def test_graph_pass_with_tap_slots_equals_the_eager_tapped_pass(taps):
    """A prefill graph with tap slots (first pass eager, then capture, then replay) writes the
    eager tapped pass's logits, lane state and tap images (each into its own state slot), bit
    for bit, and compiles nothing on replay."""
    _needs_fla()
    from hpc_cli.model.compile_watch import watch
    from hpc_cli.model.model import HybridModel, TapImage

    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, model.config.vocab_size, (300,), generator=g).tolist()
    table = list(range(5))
    images = [TapImage(p, 2 + j) for j, p in enumerate(taps)]

    pools = {False: (model.new_kv_storage("int8-g64", 8), model.new_state_slots(6)),
             True: (model.new_kv_storage("int8-g64", 8), model.new_state_slots(6))}

    def run(graphs: bool):
        model.cuda_graphs = graphs
        kv, states = pools[graphs]
        for s in range(6):
            states.reset(s)
        out = model.prefill(tokens[:260], 0, table, 1, kv, states, taps=images)
        assert out.taps == images
        torch.cuda.synchronize()
        return out.logits.clone(), [part.clone() for part in states.parts()]

    eager = run(False)
    counts = None
    for attempt in range(3):  # eager first pass, capture, replay
        if attempt == 2:
            counts = watch()
            before = counts.compilations + counts.autotunes
        got = run(True)
        assert torch.equal(got[0], eager[0]), f"attempt {attempt}: logits"
        for n, (a, b) in enumerate(zip(got[1], eager[1])):
            for slot in range(6):
                assert torch.equal(a[slot], b[slot]), f"attempt {attempt}: state part {n}, slot {slot}"
    graphs = model.prefill_graphs(pools[True][0])
    assert graphs is not None and graphs.replays >= 1 and graphs.disabled is None
    assert counts.compilations + counts.autotunes == before, "a replayed tapped pass compiled or tuned a kernel"
