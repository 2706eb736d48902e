"""The zero-split tap (spec §7.2-7.3): a prefill pass's GDN layers return the recurrent state at
planned positions inside the pass, with no second pass.

The chunked rule has the state only at chunk boundaries, so the chunk grid restarts at every tap.
The pass's rows are *spread*: each run between taps starts at a chunk boundary, and the rows after
a run's end up to the next boundary are identity rows (``q = k = v = 0``, ``g = 0``, ``beta = 0``:
decay 1 and no write, so the state passes them bit for bit). A tap is then the state at a chunk
boundary, and every output and state equals that of a pass split at the taps (a new grid at each):

* on the CPU (and wherever fla is missing) the torch chunk rule keeps the state at those
  boundaries (:func:`hpc_cli.model.gdn.chunk_states`);
* on CUDA fla's chunk kernels run once over the spread rows, except the sequential state
  recurrence (fla's ``h`` kernel), which runs once per run, chained through its fp32 final state:
  the final state of each run is a tap, stored in fp32 as the state is kept between passes. The
  runs' bounds are read on the device (the kernel's variable-length form, one sequence per
  launch), so one CUDA graph of a pass serves every placement of up to :data:`TAP_SLOTS` taps
  (a slot not used is an empty run, which passes the state through).

:func:`spread_layout` places the rows and :func:`spread` moves them there; :func:`tapped_rule` is
a whole call, :func:`spread_states` the rule over rows already spread (the torch chunk rule, or
:func:`fla_spread_rule` on CUDA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hpc_cli.model.gdn import chunk_states, fla_inputs, gated_delta_prefill

CHUNK = 64
#: the tap slots of a CUDA-graph prefill pass with taps (each slot adds one chunk of rows to its
#: GDN kernels); a pass with more taps ends at the next one (a split). One size: on an H200 at the
#: 27B widths, 8 taps in an 8k prompt (2 a pass) kept 0.958 of the prefill throughput with 4-slot
#: graphs and 0.939 with graphs of 1, 2 and 4 slots picked per pass (benchmarks/gdn_taps.py)
TAP_SLOTS = 4
#: no bound: the torch rule takes any number of taps in one call
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class SpreadLayout:
    """Where a pass's rows go when the chunk grid restarts at each tap.

    ``rows``: the spread row of each of the pass's ``L`` rows (its ``n`` real rows, then its
    padding rows, which follow the last run); ``starts``: the spread row where each run begins,
    ``[0, s_1 .. s_m]`` (multiples of ``chunk``); ``bounds``: the ``slots + 2`` bounds of the
    runs, ``starts`` then, for each slot not used, the start of one identity chunk after the last
    run, then ``size`` (so no run is empty); ``size``: the spread length, a multiple of ``chunk``
    (rows past the last real row are identity rows: a spread never ends in a partial chunk, whose
    rows fla's kernels mask rather than compute, which rounds differently)."""

    rows: list[int]
    starts: list[int]
    bounds: list[int]
    size: int

    @property
    def tap_chunks(self) -> list[int]:
        """The chunk count at each tap (the state entering the run that follows it)."""
        return [s // CHUNK for s in self.starts[1:]]


def spread_layout(n: int, taps: Sequence[int], L: int | None = None, slots: int | None = None,
                  chunk: int = CHUNK) -> SpreadLayout:
    """The layout of a pass of ``n`` real rows (``L >= n`` rows in all) with taps at the offsets
    ``taps`` (sorted, distinct, inside ``(0, n)``). ``slots``: the layout has room for that many
    taps (``size = L + chunk * slots``, the shape a CUDA graph is captured for); None: exactly
    ``len(taps)``, as short as it can be."""
    L = n if L is None else L
    taps = list(taps)
    assert all(0 < p < n for p in taps) and taps == sorted(set(taps)), f"taps {taps} not sorted inside (0, {n})"
    assert n <= L, f"{n} real rows do not fit a pass of {L}"
    m = len(taps)
    assert slots is None or m <= slots, f"{m} taps do not fit {slots} slots"
    edges = [0, *taps, n]
    rows: list[int] = []
    starts: list[int] = []
    at = 0
    for j, (a, b) in enumerate(zip(edges, edges[1:])):
        starts.append(at)
        rows.extend(range(at, at + b - a))
        at += b - a if j == m else -(-(b - a) // chunk) * chunk
    rows.extend(range(at, at + L - n))  # the pass's padding rows follow its last run
    end = -(-(at + L - n) // chunk) * chunk  # no partial chunk: identity rows up to a boundary
    if slots is None:
        return SpreadLayout(rows, starts, [*starts, end], end)
    size = L + chunk * slots
    assert end + chunk * (slots - m) <= size, f"a spread of {end} rows and {slots - m} free slots do not fit {size}"
    # a slot not used is one identity chunk (it passes the state through); the last runs to the end
    return SpreadLayout(rows, starts, [*starts, *(end + chunk * j for j in range(slots - m)), size], size)


def spread(x: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` ``[B, T, ...]`` placed at rows ``rows`` (``[T]``, device indices) of ``size`` rows,
    identity (zero) rows between (:class:`SpreadLayout`)."""
    return x.new_zeros(x.shape[0], size, *x.shape[2:]).index_copy_(1, rows, x)


def tapped_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, taps: Sequence[int],
                use_fla: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`hpc_cli.model.gdn.chunk_rule` of one sequence (``B = 1``) that also returns the fp32
    state after each of ``taps`` (offsets in ``(0, T)``, sorted, distinct), with no second call.
    A tap equals the final state of this function on the rows up to it with the same earlier
    taps, bit for bit, and every output equals a pass split at the taps; with no taps, or taps at
    multiples of 64, no row is added. Through :func:`spread_states` (fla's kernels on CUDA where
    present and ``use_fla`` is not False, else torch). Returns the output, the final state and
    the tap states, each ``[1, H_v, d_k, d_v]``."""
    t = k.shape[1]
    taps = list(taps)
    if not taps:
        out, state = gated_delta_prefill(q, k, v, g, beta, initial_state, use_fla)
        return out, state, []
    assert q.shape[0] == 1, "the tap rule runs one sequence"
    layout = spread_layout(t, taps)
    rows = torch.tensor(layout.rows, device=k.device)
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    states = torch.empty(len(taps) + 1, hv, dk, dv, dtype=torch.float32, device=q.device)
    init = (torch.zeros(1, hv, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
            else initial_state)
    bounds = torch.tensor(layout.bounds, dtype=torch.long, device=q.device)
    out = spread_states(*(spread(x, rows, layout.size) for x in (q, k, v, g, beta)), init, bounds, states, use_fla)
    return out.index_select(1, rows), states[-1:], [states[j:j + 1] for j in range(len(taps))]


def spread_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor, bounds: torch.Tensor, states: torch.Tensor,
                  use_fla: bool | None = None) -> torch.Tensor:
    """The rule over rows already spread (``[1, S, ...]``), the runs' bounds on the device
    (``[slots + 2]``): writes the state after each run into ``states`` ``[slots + 1, H_v, d_k,
    d_v]`` (the taps, then the final state) and returns the output ``[1, S, H_v, d_v]``. fla's
    kernels on CUDA (no host value read), else the torch rule (which reads ``bounds``)."""
    if q.is_cuda and use_fla is not False and fla_spread_supported():
        return fla_spread_rule(q, k, v, g, beta, initial_state, bounds, states)
    keep = [int(b) // CHUNK for b in bounds.tolist()[1:]]
    out, _, kept = chunk_states(q, k, v, g, beta, initial_state, CHUNK, keep)
    for j, s in enumerate(kept):
        states[j].copy_(s[0])
    return out


# -- fla on CUDA --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FlaParts:
    l2norm: Callable
    cumsum: Callable
    intra: Callable
    h_kernel: Callable
    output: Callable
    rcp_ln2: float


@functools.lru_cache(maxsize=1)
def _fla_parts() -> _FlaParts | None:
    """The pieces of fla's chunked gated delta rule (fla 0.6's layout), or None."""
    from hpc_cli.model.fla_configs import pin

    pin()
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # fla is optional, and these are internals: any failure means "split instead"
        return None
    return _FlaParts(l2norm_fwd, chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra,
                     chunk_gated_delta_rule_fwd_kernel_h_blockdim64, chunk_fwd_o, RCP_LN2)


def fla_spread_supported() -> bool:
    return _fla_parts() is not None


def fla_spread_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor, bounds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """fla's chunk rule over spread rows, the recurrence run per run (see the module doc): the
    same kernels, in the same order, as ``chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel``
    (whose call this equals bit for bit with no taps), but the ``h`` kernel launched once per
    run, each launch reading its ``[begin, end)`` from ``bounds`` and chaining the fp32 state
    through ``states``."""
    import triton

    p = _fla_parts()
    assert p is not None, "fla's chunk kernels are not importable"
    qq, kk, vv = fla_inputs(q, k, v)
    B, T, H, K = kk.shape
    HV, V = vv.shape[2], vv.shape[3]
    assert B == 1, "the spread rule runs one sequence"
    slots = bounds.shape[0] - 2
    assert states.shape == (slots + 1, HV, K, V) and states.dtype == torch.float32, \
        f"states {tuple(states.shape)} {states.dtype}, want {(slots + 1, HV, K, V)} float32"
    qn, _ = p.l2norm(qq)
    kn, _ = p.l2norm(kk)
    gc = p.cumsum(g.float(), chunk_size=CHUNK, scale=p.rcp_ln2)
    w, u, _ = p.intra(k=kn, v=vv, g=gc, beta=beta.to(vv.dtype), chunk_size=CHUNK)
    h = kn.new_empty(B, triton.cdiv(T, CHUNK), HV, K, V)
    v_new = torch.empty_like(u)
    chunks = bounds // CHUNK
    init = initial_state.float().contiguous()

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]) * HV,)

    for j in range(slots + 1):
        p.h_kernel[grid](k=kn, v=u, w=w, v_new=v_new, g=gc, gk=None, h=h,
                         h0=init if j == 0 else states[j - 1:j], ht=states[j:j + 1],
                         cu_seqlens=bounds[j:j + 2], chunk_offsets=chunks[j:j + 1],
                         T=T, H=H, HV=HV, K=K, V=V, BT=CHUNK, STATE_V_FIRST=False)
    o = p.output(q=qn, k=kn, v=v_new, h=h, g=gc, scale=K ** -0.5, chunk_size=CHUNK)
    return o.to(qq.dtype)


def tap_capacity(device: torch.device | str) -> int:
    """How many exact taps a prefill pass on ``device`` takes itself: any number on the CPU (the
    torch rule), :data:`TAP_SLOTS` on CUDA where fla's kernels are there (a graph's slots), none
    elsewhere (the pass splits at each tap)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return UNBOUNDED
    return TAP_SLOTS if kind == "cuda" and fla_spread_supported() else 0
