"""hpc_kernels.gdn_state_taps: the chunked state recurrence that also writes the state at tap
positions inside a chunk. The torch twin against an fp64 token-by-token recurrence (every tap, at
every phase of a chunk), the Triton kernel against the twin in Triton's interpreter (a child
process: TRITON_INTERPRET is read at import). The kernel against fla's own call, bit for bit, is
a GPU test (tests/model/test_gdn_taps_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from .helpers import run_interpreted

CHUNK = 64


def _inputs(t: int, hk: int, hv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(1, t, hk, d, generator=g), dim=-1)
    v = torch.randn(1, t, hv, d, generator=g)
    gate = -torch.rand(1, t, hv, generator=g) * 0.2
    beta = torch.rand(1, t, hv, generator=g)
    s0 = torch.randn(1, hv, d, d, generator=g) * 0.1
    return k, v, gate, beta, s0


def _wy(k, v, gate, beta, dtype):
    """The chunk-local WY representation the recurrence reads (as fla's intra kernels form it):
    ``G`` the gate's cumulative sum inside each chunk in log2 units, ``w = T (beta 2^G k)``,
    ``u = T (beta v)``, ``T = (I + strictly-lower(beta_i 2^(G_i - G_j) k_i . k_j))^-1``."""
    _, t, hk, d = k.shape
    hv = v.shape[2]
    kk = k[0].repeat_interleave(hv // hk, dim=1).double()  # [T, HV, d]
    vv, bb = v[0].double(), beta[0].double()
    G = torch.empty(t, hv, dtype=torch.float64)
    w = torch.empty(t, hv, d, dtype=torch.float64)
    u = torch.empty(t, hv, d, dtype=torch.float64)
    for a in range(0, t, CHUNK):
        b = min(t, a + CHUNK)
        G[a:b] = gate[0, a:b].double().cumsum(0) / torch.log(torch.tensor(2.0, dtype=torch.float64))
        for h in range(hv):
            kc, g2 = kk[a:b, h], G[a:b, h]
            A = (bb[a:b, h, None] * (kc @ kc.T) * torch.exp2(g2[:, None] - g2[None, :])).tril(-1)
            Tm = torch.linalg.inv(torch.eye(b - a, dtype=torch.float64) + A)
            w[a:b, h] = Tm @ (bb[a:b, h, None] * torch.exp2(g2)[:, None] * kc)
            u[a:b, h] = Tm @ (bb[a:b, h, None] * vv[a:b, h])
    return (k.to(dtype), w.unsqueeze(0).to(dtype), u.unsqueeze(0).to(dtype), G.unsqueeze(0).float())


def _fp64_states(k, v, gate, beta, s0):
    """The delta rule token by token in fp64: the state after every position."""
    hv = v.shape[2]
    kk = k[0].repeat_interleave(hv // k.shape[2], dim=1).double()
    state, out = s0[0].double(), {}
    for i in range(k.shape[1]):
        state = state * gate[0, i].double().exp()[:, None, None]
        delta = (v[0, i].double() - torch.einsum("hkv,hk->hv", state, kk[i])) * beta[0, i].double()[:, None]
        state = state + kk[i][:, :, None] * delta[:, None, :]
        out[i + 1] = state
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_taps_every_phase_against_the_fp64_recurrence(dtype):
    """Taps at every phase 1..64 of a chunk, and in the first and last chunks: each equals the
    fp64 recurrence at its position (fp32 inputs: to 1e-5; bf16: within its rounding), and the
    final state too; a tap never changes the pass's final state or new values."""
    from hpc_kernels.gdn_state_taps import state_taps_ref

    t, hk, hv, d = 200, 2, 4, 32
    k, v, gate, beta, s0 = _inputs(t, hk, hv, d, seed=3)
    ref = _fp64_states(k, v, gate, beta, s0)
    kk, w, u, G = _wy(k, v, gate, beta, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    none = s0.clone()  # the lane's state in slot 0, read and written in place
    empty, zero = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    h0, v0 = state_taps_ref(kk, w, u, G, none, zero, empty, empty)
    assert _rel(none[0], ref[t]) < tol
    for taps in ([64 + r for r in range(1, 33)], [64 + r for r in range(33, 65)], [1, 63, 64, 129, 190, 199]):
        states = torch.empty(len(taps) + 2, hv, d, d)
        states[0] = s0[0]
        dst = torch.arange(len(taps)).flip(0) + 2  # any slots, in any order
        h, vn = state_taps_ref(kk, w, u, G, states, zero, torch.tensor(taps), dst)
        assert torch.equal(h, h0) and torch.equal(vn, v0) and torch.equal(states[0], none[0])
        for j, p in enumerate(taps):
            got = states[int(dst[j])]
            assert _rel(got, ref[p]) < tol, f"tap {p}: {_rel(got, ref[p]):.2e}"


def test_twin_unused_slots_and_truncation():
    """A slot holding 0 writes nothing; a tap equals the final state of the same recurrence on
    the rows up to it (the truncated call), bit for bit."""
    from hpc_kernels.gdn_state_taps import state_taps_ref

    t, hk, hv, d = 150, 1, 2, 16
    kk, w, u, G = _wy(*_inputs(t, hk, hv, d, seed=4)[:4], torch.bfloat16)
    s0 = _inputs(t, hk, hv, d, seed=4)[4]
    # the lane's state in slot 3 of the same tensor, read and written in place
    dest = torch.full((4, hv, d, d), 7.0)
    dest[3] = s0[0]
    lane = torch.tensor([3])
    state_taps_ref(kk, w, u, G, dest, lane, torch.tensor([37, 101, 0]), torch.tensor([0, 1, 2]))
    assert torch.equal(dest[2], torch.full((hv, d, d), 7.0))
    empty, zero = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    whole = s0.clone()
    state_taps_ref(kk, w, u, G, whole, zero, empty, empty)
    assert torch.equal(dest[3], whole[0])
    for j, p in enumerate((37, 101)):
        trunc = s0.clone()
        state_taps_ref(kk[:, :p], w[:, :p], u[:, :p], G[:, :p], trunc, zero, empty, empty)
        assert torch.equal(dest[j], trunc[0]), f"tap {p}"


# -- the Triton kernel in the interpreter --------------------------------------------------------

# (T, key heads, value heads, head dim, taps, dtype): fp32 cases check the kernel's indexing to
# the order of fp32 sums; the bf16 case its rounding points, to the interpreter's bf16 rounding
# (it rounds a register converted to bf16 differently from torch: ~4e-3 relative)
CASES = [(130, 1, 2, 64, [1, 63, 64, 65, 129], "float32"), (64, 2, 2, 128, [17, 64, 0, 0], "float32"),
         (200, 1, 1, 32, [100], "float32"), (70, 1, 2, 128, [], "float32"), (130, 1, 2, 64, [5, 64, 100], "bfloat16")]


def _child() -> list[dict]:
    from hpc_kernels.gdn_state_taps import state_taps, state_taps_ref

    out = []
    for t, hk, hv, d, taps, dtype in CASES:
        k, v, gate, beta, s0 = _inputs(t, hk, hv, d, seed=t)
        kk, w, u, G = _wy(k, v, gate, beta, getattr(torch, dtype))
        kk = kk.repeat_interleave(hv // hk, dim=2).contiguous()  # as fla_inputs hands them over
        at = torch.tensor(taps, dtype=torch.long)
        dst = torch.arange(len(taps), dtype=torch.long).flip(0)
        lane = torch.tensor([len(taps)])  # the lane's slot, after the taps', read and written in place
        got_states = torch.full((len(taps) + 1, hv, d, d), 7.0)
        got_states[-1] = s0[0]
        ref_states = got_states.clone()
        h, vn = state_taps(kk, w, u, G, got_states, lane, at, dst)
        rh, rvn = state_taps_ref(kk, w, u, G, ref_states, lane, at, dst)
        out.append({"case": [t, hk, hv, d, taps, dtype], "h": _rel(h, rh), "v_new": _rel(vn, rvn),
                    "states": [_rel(a, b) for a, b in zip(got_states, ref_states)],
                    "unused_kept": all(bool((got_states[int(dst[j])] == 7.0).all())
                                       for j, p in enumerate(taps) if p == 0)})
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_interpreted_kernel_equals_the_twin():
    cases = run_interpreted("tests.model.test_gdn_state_taps")
    assert len(cases) == len(CASES)
    for c in cases:
        tol = 1e-5 if c["case"][-1] == "float32" else 2e-2
        assert max(c["h"], c["v_new"], *c["states"]) < tol, c
        assert c["unused_kept"], c


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    print(json.dumps(_child()))
