"""The zero-split tap (spec §7.2-7.3): a prefill pass's GDN layers return the recurrent state at
planned positions inside the pass, with no second pass.

The chunk grid stays where it is. The chunked rule walks the pass in chunks of 64 rows with the
state at each chunk boundary; the state after the first ``r`` rows of a chunk is that chunk's
update with its last row at ``r - 1`` and the later rows weighted zero (the chunk-local system is
lower-triangular, so they do not enter the earlier rows): one masked chunk update where a tap
falls, the same products a call ending at the tap computes for its last chunk.

* On CUDA fla's chunk kernels run over the pass as in fla's own call, except the sequential state
  recurrence, which is :mod:`hpc_kernels.gdn_state_taps`: it writes each chunk's state as fla's
  does and each tap's fp32 state into the tap's state slot, and reads the lane's state from and
  writes it back to its slot. The taps and slots are read on the device, so one CUDA graph of a
  pass serves every placement of up to :data:`TAP_SLOTS` taps (a slot not used holds offset 0).
  The output and final state are fla's own call's bit for bit; a tap is the final state of fla's
  own call on the rows up to it.
* On the CPU (and wherever fla is missing) the torch chunk rule does the same
  (:func:`hpc_cli.model.gdn.chunk_states`).

:func:`tap_rule` is the rule with taps given on the device, :func:`tapped_rule` a whole call with
host offsets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hpc_cli.model.gdn import chunk_states, fla_inputs, gated_delta_prefill

CHUNK = 64
#: the tap slots of a CUDA-graph prefill pass with taps (a slot costs one scalar read per chunk of
#: the tap recurrence); a pass with more taps ends at the next one (a split)
TAP_SLOTS = 4


def tapped_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, taps: Sequence[int],
                use_fla: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`hpc_cli.model.gdn.chunk_rule` of one sequence (``B = 1``) that also returns the fp32
    state after each of ``taps`` (offsets in ``(0, T)``, sorted, distinct), with no second call
    (:func:`tap_rule`). Returns the output, the final state and the tap states, each
    ``[1, H_v, d_k, d_v]``."""
    taps = list(taps)
    if not taps:
        out, state = gated_delta_prefill(q, k, v, g, beta, initial_state, use_fla)
        return out, state, []
    assert q.shape[0] == 1, "the tap rule runs one sequence"
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    m = len(taps)
    slots = -(-m // TAP_SLOTS) * TAP_SLOTS  # the slot counts the warm-up compiles (0 = a slot not used)
    # the taps' states in slots 0 .. slots-1, the entering and then the final state in the last
    dest = torch.zeros(slots + 1, hv, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        dest[slots].copy_(initial_state[0])
    at = torch.tensor([*taps, *([0] * (slots - m))], dtype=torch.long, device=q.device)
    slot = torch.tensor([slots], device=q.device)
    out = tap_rule(q, k, v, g, beta, dest, slot, at, torch.arange(slots, device=q.device), use_fla)
    return out, dest[slots:], [dest[j:j + 1] for j in range(m)]


def tap_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, slot: torch.Tensor, taps: torch.Tensor, dst: torch.Tensor,
             use_fla: bool | None = None) -> torch.Tensor:
    """The rule over one sequence ``[1, T, ...]`` from the state ``states[slot]`` (``states``
    ``[N, H_v, d_k, d_v]`` fp32, e.g. a GDN layer's state slots; ``slot`` ``[1]`` on the device),
    whose final state it writes back there, with the taps ``taps`` (``[S]`` offsets in ``(0, T)``
    on the device, sorted, then ``0`` for each slot not used): each used tap's fp32 state goes to
    ``states[dst[j]]`` (``dst`` ``[S]``, never ``slot``). Returns the output ``[1, T, H_v, d_v]``.

    The chunk grid stays where it is: the output and final state are those of the call without
    taps bit for bit, and a tap is the final state of the call on the rows up to it. On CUDA
    through fla's kernels and :mod:`hpc_kernels.gdn_state_taps` (no host value read), elsewhere
    through the torch chunk rule (:func:`hpc_cli.model.gdn.chunk_states`, which reads the taps)."""
    if q.is_cuda and use_fla is not False and fla_taps_supported(k.shape[3]):
        return fla_tap_rule(q, k, v, g, beta, states, slot, taps, dst)
    used = [(int(p), int(d)) for p, d in zip(taps.tolist(), dst.tolist()) if int(p) > 0]
    out, final, kept = chunk_states(q, k, v, g, beta, states.index_select(0, slot), CHUNK, [p for p, _ in used])
    for (_, d), s in zip(used, kept):
        states[d].copy_(s[0])
    states.index_copy_(0, slot, final)
    return out


# -- fla on CUDA --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FlaParts:
    l2norm: Callable
    cumsum: Callable
    intra: Callable
    output: Callable
    rcp_ln2: float


@functools.lru_cache(maxsize=1)
def _fla_parts() -> _FlaParts | None:
    """The pieces of fla's chunked gated delta rule (fla 0.6's layout) around its state
    recurrence, or None."""
    from hpc_cli.model.fla_configs import pin

    pin()
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # fla is optional, and these are internals: any failure means "split instead"
        return None
    return _FlaParts(l2norm_fwd, chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra, chunk_fwd_o, RCP_LN2)


def fla_taps_supported(key_dim: int | None = None) -> bool:
    """Whether CUDA passes take taps themselves: fla's chunk kernels import and the tap
    recurrence kernel takes the key head dim (any, when not given)."""
    from hpc_kernels import gdn_state_taps

    return _fla_parts() is not None and gdn_state_taps.supported(key_dim or 1)


def fla_tap_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, slot: torch.Tensor, taps: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """fla's chunk rule with its state recurrence replaced by the tap recurrence
    (:func:`hpc_kernels.gdn_state_taps.state_taps`), from and back into ``states[slot]``: the
    same kernels, in the same order, as ``chunk_gated_delta_rule`` with
    ``use_qk_l2norm_in_kernel`` (whose output and final state this equals bit for bit), plus each
    tap's state written into ``states[dst[j]]``."""
    from hpc_kernels.gdn_state_taps import state_taps

    p = _fla_parts()
    assert p is not None, "fla's chunk kernels are not importable"
    qq, kk, vv = fla_inputs(q, k, v)
    K = kk.shape[3]
    qn, _ = p.l2norm(qq)
    kn, _ = p.l2norm(kk)
    gc = p.cumsum(g.float(), chunk_size=CHUNK, scale=p.rcp_ln2)
    w, u, _ = p.intra(k=kn, v=vv, g=gc, beta=beta.to(vv.dtype), chunk_size=CHUNK)
    h, v_new = state_taps(kn, w, u, gc, states, slot, taps, dst)
    o = p.output(q=qn, k=kn, v=v_new, h=h, g=gc, scale=K ** -0.5, chunk_size=CHUNK)
    return o.to(qq.dtype)


def tap_capacity(device: torch.device | str, key_dim: int | None = None) -> int:
    """How many exact taps a prefill pass on ``device`` takes itself (of a model whose GDN key
    heads have ``key_dim``): :data:`TAP_SLOTS` on the CPU (the torch rule) and on CUDA where fla's
    kernels and the tap recurrence take the model (a graph's slots), none elsewhere (the pass
    splits at each tap)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return TAP_SLOTS
    return TAP_SLOTS if kind == "cuda" and fla_taps_supported(key_dim) else 0
