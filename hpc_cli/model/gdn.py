"""The gated delta rule (Gated DeltaNet's recurrence) in torch, and fla's kernels on CUDA.

Per value head ``h`` with state ``S`` ``[d_k, d_v]`` (fp32), for each token::

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T
    o  = S^T (q / sqrt(d_k))

with ``q`` and ``k`` l2-normalised. ``chunk_rule`` evaluates a run of tokens in chunks of 64
(the UT-transform form); ``recurrent_rule`` steps token by token (decode). Both take
``q, k`` ``[B, T, H_k, d_k]``, ``v`` ``[B, T, H_v, d_v]``, ``g, beta`` ``[B, T, H_v]`` and an
initial state ``[B, H_v, d_k, d_v]``, and return the output ``[B, T, H_v, d_v]`` in ``v``'s
dtype and the final state in fp32. ``q``/``k`` heads serve ``H_v / H_k`` consecutive value heads.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    n_k, n_v = k.shape[2], v.shape[2]
    if n_k != n_v:
        q = q.repeat_interleave(n_v // n_k, dim=2)
        k = k.repeat_interleave(n_v // n_k, dim=2)
    # [B, H, T, d] in fp32
    q, k, v = (x.transpose(1, 2).float().contiguous() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float().contiguous() for x in (g, beta))
    q = l2norm(q)
    k = l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (UT-transform) form, fp32. Products that involve only ``q`` and ``k`` (``q k^T``,
    ``k k^T``) run once per key head and are shared by the value heads it serves; the triangular
    system of each chunk is inverted once (a solve against the identity: 64 right-hand sides
    instead of two solves of ``d_k`` and ``d_v``) and applied by matrix products."""
    out, state, _ = chunk_states(q, k, v, g, beta, initial_state, chunk, ())
    return out, state


#: on the CPU a run of more than :data:`CPU_GROUP_MIN_CHUNKS` chunks goes through :func:`chunk_states`
#: in groups of key heads (with the value heads they serve) whose recurrent state takes at most
#: this many bytes: a run's intermediates (``[heads, chunks, 64, d]`` each, tens of MB for all 48
#: value heads of a 2k-token run) then stay in the caches. The heads are independent, so each
#: head's numbers are the same bit for bit. The 27B mixer widths (16 key / 48 value heads of 128)
#: on the 2-core CPU: 2,400 tokens 0.22-0.24 s against 0.37-0.38 s at once, 400 tokens 34 against
#: 48 ms, 200 tokens 22 against 33 ms; runs of one or two chunks are faster at once (100 tokens 10.5
#: against 12.1 ms: each group costs its own launches).
CPU_GROUP_STATE_BYTES = 1 << 20
CPU_GROUP_MIN_CHUNKS = 2


def chunk_states(q, k, v, g, beta, initial_state, chunk: int, taps: Sequence[int]):
    """:func:`_chunk_states` (the whole docstring there), over groups of heads on the CPU
    (:data:`CPU_GROUP_STATE_BYTES`)."""
    hk, hv = k.shape[2], v.shape[2]
    rep = hv // hk
    per = max(1, CPU_GROUP_STATE_BYTES // (rep * k.shape[3] * v.shape[3] * 4))
    if q.device.type != "cpu" or per >= hk or k.shape[1] <= CPU_GROUP_MIN_CHUNKS * chunk:
        return _chunk_states(q, k, v, g, beta, initial_state, chunk, taps)
    parts = []
    for a in range(0, hk, per):
        kh, vh = slice(a, a + per), slice(a * rep, (a + per) * rep)
        parts.append(_chunk_states(q[:, :, kh], k[:, :, kh], v[:, :, vh], g[:, :, vh], beta[:, :, vh],
                                   None if initial_state is None else initial_state[:, vh], chunk, taps))
    out = torch.cat([o for o, _, _ in parts], dim=2)
    state = torch.cat([st for _, st, _ in parts], dim=1)
    kept = [torch.cat([kp[j] for _, _, kp in parts], dim=1) for j in range(len(taps))]
    return out, state, kept


def _chunk_states(q, k, v, g, beta, initial_state, chunk: int, taps: Sequence[int]):
    """:func:`chunk_rule`, also returning the state after each position in ``taps`` (in ``(0,
    T]``; the zero-split tap, spec §7.2-7.3). The grid stays where it is: the state after the
    first ``r`` rows of chunk ``c`` is the chunk's update with its last row at ``r - 1`` and the
    rows from ``r`` on weighted zero (the chunk's triangular system is lower-triangular, so those
    rows do not enter the earlier ones), the same products a call ending at the tap computes for
    its last chunk: a tap equals that call's final state bit for bit, and the output and final
    state do not change."""
    out_dtype = v.dtype
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    rep = hv // hk
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, d] -> [B, H, n, C, d] (a view when unpadded)
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.view(b, n, chunk, x.shape[2], x.shape[3]).permute(0, 3, 1, 2, 4)

    def gates(x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, H, n, C]
        x = x.float()
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.view(b, n, chunk, hv).permute(0, 3, 1, 2)

    qh = heads(l2norm(q.float()) * (dk ** -0.5))  # [B, Hk, n, C, dk]
    kh = heads(l2norm(k.float()))
    vh = heads(v.float())  # [B, Hv, n, C, dv]
    bb = gates(beta)
    cg = gates(g).cumsum(-1)  # log decay from the chunk start to each position (inclusive)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cg.unsqueeze(-1) - cg.unsqueeze(-2)).masked_fill_(~lower, float("-inf")).exp_()
    decay = decay.view(b, hk, rep, n, chunk, chunk)
    kk = (kh @ kh.transpose(-1, -2)).unsqueeze(2)  # [B, Hk, 1, n, C, C]
    qk = (qh @ kh.transpose(-1, -2)).unsqueeze(2)
    # (I + A) with A strictly lower: A[i, j] = beta_i k_i.k_j decay(i, j); attn = q_i.k_j decay(i, j)
    system = (kk * decay * bb.view(b, hk, rep, n, chunk, 1)).view(b, hv, n, chunk, chunk).tril_(-1)
    attn = (qk * decay).view(b, hv, n, chunk, chunk)
    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    inv = torch.linalg.solve_triangular(system + eye, eye.expand_as(system), upper=False, unitriangular=True)
    kv_heads = kh.unsqueeze(2).expand(b, hk, rep, n, chunk, dk).reshape(b, hv, n, chunk, dk)
    ecg = cg.exp()
    u = inv @ (vh * bb.unsqueeze(-1))
    w = inv @ (kv_heads * (bb * ecg).unsqueeze(-1))
    qd = (qh.unsqueeze(2) * ecg.view(b, hk, rep, n, chunk, 1)).view(b, hv, n, chunk, dk)
    kd = kv_heads * (cg[..., -1:] - cg).exp().unsqueeze(-1)
    total = ecg[..., -1][..., None, None]
    state = (torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float().clone())
    assert all(0 < p <= t for p in taps), f"taps {list(taps)} outside (0, {t}]"
    inside: dict[int, list[int]] = {}  # chunk -> the rows its taps take
    for p in taps:
        inside.setdefault((p - 1) // chunk, []).append(p - (p - 1) // chunk * chunk)
    kept: dict[int, torch.Tensor] = {}
    rows = torch.arange(chunk, device=q.device)
    out = torch.empty(b, hv, n, chunk, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = qd[:, :, i] @ state + attn[:, :, i] @ v_new
        for r in inside.get(i, ()):
            c = cg[:, :, i]
            weight = torch.where(rows < r, (c[..., r - 1:r] - c).exp(), 0.0)  # (later rows' exp may overflow)
            kd_r = kv_heads[:, :, i] * weight.unsqueeze(-1)
            kept[i * chunk + r] = state * ecg[:, :, i, r - 1][..., None, None] + kd_r.transpose(-1, -2) @ v_new
        state = state * total[:, :, i] + kd[:, :, i].transpose(-1, -2) @ v_new
    out = out.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, hv, dv)[:, :t]
    return out.to(out_dtype), state, [kept[p] for p in taps]


def causal_conv_time_major(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The GDN layer's depthwise causal conv on the CPU, time-major: ``rows`` ``[k-1+T, C]`` (the
    previous conv state's columns, then the run's pre-conv rows), ``weight`` ``[C, 1, k]`` ->
    ``[T, C]`` in the weight's dtype (accumulated in fp32 for narrower ones). ``k`` multiply-adds
    over contiguous ``[T, C]`` slices, vectorised along the channels: several times faster on the
    CPU than the grouped ``conv1d`` (oneDNN's depthwise kernel over ``[C, T]``), with the same sums
    in the same order (equal results in fp32)."""
    k = weight.shape[-1]
    t = rows.shape[0] - (k - 1)
    acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    taps = weight[:, 0, :].to(acc).t().contiguous()  # [k, C]
    rows = rows.to(weight.dtype).to(acc)
    out = rows[0:t] * taps[0]
    for j in range(1, k):
        out.addcmul_(rows[j:j + t], taps[j])
    return out.to(weight.dtype)


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None, in_place: bool = False,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token. ``in_place``: ``initial_state`` (fp32, contiguous) is stepped where
    it lies and returned, no copy made (the same arithmetic, so the same bits). ``keep`` ``[b, t,
    h, dk, dv]``: every token's state is copied there after its step (a verify pass's columns).
    Each step's operands are contiguous ``[b, h, ...]`` slices whatever ``t`` is, so token ``i``
    of a run computes what a run of that token alone (``t == 1``) from the same state computes,
    bit for bit (an elementwise op on the CPU may round differently on a strided operand)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    if in_place:
        assert initial_state is not None and initial_state.dtype == torch.float32 and initial_state.is_contiguous(), \
            "a state stepped in place is fp32 and contiguous"
        state = initial_state
    else:
        state = (torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
                 else initial_state.float().clone(memory_format=torch.contiguous_format))
    out = torch.empty_like(v)
    # the state updated in place, its products as batched matrix products over the b * h heads:
    # each step reads and writes the state about 3 times where elementwise products and sums
    # over [b, h, dk, dv] temporaries did about 10 times (the 27B mixer widths, 3 MB of state a
    # layer: through HTTP on the 2-core CPU a token of the hidden-256 checkpoint took 12.7 against
    # 14.2 ms)
    s3 = state.view(b * h, dk, dv)
    for i in range(t):
        s3.mul_(g[:, :, i].contiguous().exp().reshape(b * h, 1, 1))
        kt = k[:, :, i].reshape(b * h, 1, dk)
        delta = (v[:, :, i].reshape(b * h, 1, dv) - torch.bmm(kt, s3)) * beta[:, :, i].reshape(b * h, 1, 1)
        s3.baddbmm_(kt.transpose(1, 2), delta)  # state += k^T delta
        out[:, :, i] = torch.bmm(q[:, :, i].reshape(b * h, 1, dk), s3).view(b, h, dv)
        if keep is not None:
            keep[:, i].copy_(state)
    return out.transpose(1, 2).to(out_dtype), state


@functools.cache
@functools.lru_cache(maxsize=1)
def _fla():
    """fla's gated delta rule kernels, or None when fla is not importable."""
    from hpc_cli.model.fla_configs import pin

    pin()  # the shipped launch configurations of this GPU, before fla reads its settings
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # fla is optional; any import failure falls back to torch
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_available() -> bool:
    return _fla() is not None


def fla_inputs(q, k, v):
    n_k, n_v = k.shape[2], v.shape[2]
    if n_k != n_v:  # older fla releases need equal head counts; repeating is cheap next to the kernel
        q = q.repeat_interleave(n_v // n_k, dim=2)
        k = k.repeat_interleave(n_v // n_k, dim=2)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _fla_rule(which: int, q, k, v, g, beta, initial_state):
    """fla's chunk (0) or fused recurrent (1) kernel, called by keyword only: the signatures
    differ between releases (fused_recurrent has gk/gv before beta)."""
    qq, kk, vv = fla_inputs(q, k, v)
    out, state = _fla()[which](q=qq, k=kk, v=vv, g=g.float(), beta=beta.to(vv.dtype),
                               initial_state=initial_state.float().contiguous(), output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
    return out, state.float()


def gated_delta_prefill(q, k, v, g, beta, initial_state, use_fla: bool | None = None):
    """A run of tokens (prefill chunk): fla's chunk kernel on CUDA when present, else torch."""
    if use_fla is False or not q.is_cuda or _fla() is None:
        return chunk_rule(q, k, v, g, beta, initial_state)
    return _fla_rule(0, q, k, v, g, beta, initial_state)


def gated_delta_decode(q, k, v, g, beta, initial_state, use_fla: bool | None = None, in_place: bool = False):
    """One token per lane (``T == 1``): fla's fused recurrent kernel on CUDA when present, else torch
    (``in_place``: the torch rule steps ``initial_state`` where it lies, :func:`recurrent_rule`)."""
    if use_fla is False or not q.is_cuda or _fla() is None:
        return recurrent_rule(q, k, v, g, beta, initial_state, in_place=in_place)
    return _fla_rule(1, q, k, v, g, beta, initial_state)


# -- the layer ---------------------------------------------------------------------------------
from torch import nn  # noqa: E402

from hpc_cli.model.layers import GatedRMSNorm, Linear, fused, param  # noqa: E402
from hpc_kernels import causal_conv  # noqa: E402

if TYPE_CHECKING:
    from hpc_cli.model.merged import MergedProjection
    from hpc_kernels.split_sums import SplitSums


class ConvWindow:
    """A run's conv window ``[C, k-1+T]``: the previous conv state's ``k-1`` columns, then the
    run's pre-conv projections as columns. Held either as one ``columns`` tensor (a view where the
    conv read it so) or as its two parts, ``state`` ``[C, k-1]`` and ``rows`` ``[T, C]`` (the fused
    conv reads the rows where they are, so no window is built; the few columns a conv state or a
    tap keeps are gathered from the parts)."""

    __slots__ = ("columns", "state", "rows")

    def __init__(self, columns: torch.Tensor | None = None, state: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None) -> None:
        assert (columns is None) != (state is None or rows is None), "a window is its columns or its two parts"
        self.columns, self.state, self.rows = columns, state, rows

    def cols(self, index: torch.Tensor) -> torch.Tensor:
        """The columns ``index`` (``[n]`` on the device) ``[C, n]``, by advanced indexing: one
        thread per element (``index_select`` along the columns loops over them in each thread, 7 us
        a GDN layer for 15 columns on an H200)."""
        if self.columns is not None:
            return self.columns[:, index]
        k1 = self.state.shape[1]
        from_state = self.state[:, index.clamp(max=k1 - 1)]
        from_rows = self.rows[(index - k1).clamp(min=0)].t()
        return torch.where(index < k1, from_state, from_rows)

    def span(self, a: int, b: int) -> torch.Tensor:
        """The columns ``[a, b)`` ``[C, b - a]``."""
        if self.columns is not None:
            return self.columns[:, a:b]
        k1 = self.state.shape[1]
        parts = [self.state[:, a:min(b, k1)]] if a < k1 else []
        if b > k1:
            parts.append(self.rows[max(a - k1, 0):b - k1].t())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer (HF ``linear_attn``).

    State per sequence: the conv window (the last ``kernel-1`` pre-conv ``qkv`` columns, model
    dtype, ``[conv_dim, kernel-1]``) and the recurrent state (fp32, ``[H_v, d_k, d_v]``).
    """

    def __init__(self, cfg, device=None, dtype=None) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.d_k, self.n_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, self.conv_dim, **fk)
        self.in_proj_z = Linear(h, self.value_dim, **fk)
        self.in_proj_b = Linear(h, self.n_v, **fk)
        self.in_proj_a = Linear(h, self.n_v, **fk)
        self.conv1d = nn.Module()
        self.conv1d.weight = param(self.conv_dim, 1, self.kernel, **fk)
        self.dt_bias = param(self.n_v, **fk)
        self.A_log = param(self.n_v, **fk)
        self.norm = GatedRMSNorm(self.d_v, eps=cfg.rms_norm_eps, **fk)
        self.out_proj = Linear(self.value_dim, h, **fk)
        self.use_fla: bool | None = None  # None: fla on CUDA when importable
        #: the four input projections as one or two products (:mod:`hpc_cli.model.merged`)
        self.merged: "MergedProjection | None" = None

    def _project(self, x: torch.Tensor):
        if self.merged is not None:
            return self.merged(x)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _heads(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, lead: tuple[int, ...]):
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(*lead, self.n_k, self.d_k)
        k = k.reshape(*lead, self.n_k, self.d_k)
        v = v.reshape(*lead, self.n_v, self.d_v)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, beta

    def _finish(self, core: torch.Tensor, z: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        """The gated norm and ``out_proj``; ``unsummed``: its split sums where it has them
        (:meth:`~hpc_cli.model.layers.Linear.unsummed`)."""
        lead = core.shape[:-2]
        y = self.norm(core, z.unflatten(-1, (self.n_v, self.d_v))).reshape(*lead, self.value_dim)
        return self.out_proj.unsummed(y) if unsummed else self.out_proj(y)

    def _mix(self, x: torch.Tensor, conv_state: torch.Tensor):
        """The projections, the conv window (:class:`ConvWindow`: the previous conv state, then
        this run's pre-conv columns) and the gated delta rule's inputs of a run of ``T`` tokens."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        w = self.conv1d.weight
        if fused(mixed, w):  # one launch, time-major, no window copy
            window = ConvWindow(state=conv_state.to(mixed.dtype), rows=mixed)
            mixed = causal_conv.conv_silu(window.state, mixed, w[:, 0, :])
        elif x.device.type == "cpu":  # time-major: the window is a view of the rows the conv reads
            rows = torch.cat([conv_state.to(mixed.dtype).t(), mixed], dim=0)  # [k-1+T, C]
            window = ConvWindow(columns=rows.t())
            conv = causal_conv_time_major(rows, w).t()  # [C, T]
            mixed = F.silu(conv).to(mixed.dtype).transpose(0, 1)
        else:
            columns = torch.cat([conv_state.to(mixed.dtype), mixed.transpose(0, 1)], dim=-1)  # [C, k-1+T]
            window = ConvWindow(columns=columns)
            conv = F.conv1d(columns.unsqueeze(0).to(w.dtype), w, groups=self.conv_dim)[0]  # [C, T]
            mixed = F.silu(conv).to(mixed.dtype).transpose(0, 1)
        q, k, v, g, beta = self._heads(mixed, b, a, (1, t))
        return window, z, q, k, v, g.view(1, t, -1), beta.view(1, t, -1)

    def _mix_padded(self, x: torch.Tensor, conv_state: torch.Tensor, valid: int | None, rows: "ValidRows | None"):
        """:meth:`_mix`, the padding rows masked (zero decay and write strength: the recurrent state
        passes them unchanged) and the new conv state (the window ending at the last valid row).
        ``valid``: the valid row count (None: all); ``rows``: the same on the device (a graph)."""
        t = x.shape[0]
        window, z, q, k, v, g, beta = self._mix(x, conv_state)
        if rows is not None:
            keep = rows.mask.view(1, t, 1)
            return window, window.cols(rows.conv_index), z, q, k, v, \
                torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
        n = t if valid is None else int(valid)
        if n < t:
            g, beta = g.clone(), beta.clone()
            g[:, n:] = 0.0
            beta[:, n:] = 0.0
        return window, window.span(n, n + self.kernel - 1), z, q, k, v, g, beta

    def prefill_tapped(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor,
                       taps: Sequence[int], valid: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`prefill` (``valid``: rows past it are padding) that also returns, for each tap
        offset ``p`` in ``(0, valid)``, the conv window and the fp32 recurrent state after the
        pass's first ``p`` tokens (spec §7.3: the pre-conv columns ``[p - 3, p)``, from the previous
        conv state where ``p < 3``; the state through :func:`hpc_cli.model.gdn_taps.tapped_rule`,
        no second pass)."""
        from hpc_cli.model.gdn_taps import tapped_rule

        window, new_conv, z, q, k, v, g, beta = self._mix_padded(x, conv_state, valid, None)
        core, state, states = tapped_rule(q, k, v, g, beta, rec_state.unsqueeze(0), taps, use_fla=self.use_fla)
        k1 = self.kernel - 1
        tapped = [(window.span(p, p + k1).clone(), st[0]) for p, st in zip(taps, states)]
        return self._finish(core[0], z), new_conv, state[0], tapped

    def prefill(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, valid: int | None = None,
                rows: "ValidRows | None" = None):
        """One lane's run of ``T`` tokens. ``x`` ``[T, hidden]``; ``conv_state`` ``[conv_dim, kernel-1]``;
        ``rec_state`` ``[H_v, d_k, d_v]``. Returns the output and the new conv and recurrent states.
        ``valid``: rows past it are padding (zero decay and zero write strength, so the recurrent
        state passes them unchanged; the conv state is the window ending at the last valid row).
        ``rows``: the same, given on the device (a CUDA graph's pass: no host value in the shapes)."""
        _, new_conv, z, q, k, v, g, beta = self._mix_padded(x, conv_state, valid, rows)
        core, state = gated_delta_prefill(q, k, v, g, beta, rec_state.unsqueeze(0), self.use_fla)
        return self._finish(core[0], z), new_conv, state[0]

    def prefill_slots(self, x: torch.Tensor, conv_slots: torch.Tensor, rec_slots: torch.Tensor,
                      rows: "ValidRows", taps: torch.Tensor, image_slots: torch.Tensor) -> torch.Tensor:
        """:meth:`prefill` of the lane in state slot ``image_slots[0]`` of ``conv_slots``
        ``[N, conv_dim, kernel-1]`` and ``rec_slots`` ``[N, H_v, d_k, d_v]``, both read and written
        there (the recurrent state in place, through :func:`hpc_cli.model.gdn_taps.tap_rule`), with
        ``rows`` on the device; also writes the state images of the taps at the offsets ``taps``
        (``[S]`` on the device, ``0`` for a slot not used) into the slots ``image_slots[1:]``: the
        graph form of :meth:`prefill_tapped`. ``image_slots`` ``[1 + S]`` (on the device) is the
        lane's slot then each tap's, and ``rows.conv_index`` the new conv window's columns, then
        each tap's: one gather takes every window and one ``index_copy_`` writes them. A slot not
        used names the lane's own slot and columns, so it writes the lane's own window there (equal
        values, in any order). Returns the output."""
        from hpc_cli.model.gdn_taps import tap_rule

        k1 = self.kernel - 1
        slot = image_slots[:1]
        dst = image_slots[1:] if taps.numel() else taps  # no tap: the empty offsets stand for both
        _, cols, z, q, k, v, g, beta = self._mix_padded(x, conv_slots.index_select(0, slot)[0], None, rows)
        core = tap_rule(q, k, v, g, beta, rec_slots, slot, taps, dst, self.use_fla)
        assert cols.shape[1] == image_slots.shape[0] * k1, \
            f"{cols.shape[1]} conv columns for {image_slots.shape[0]} slots"
        conv_slots.index_copy_(0, image_slots, cols.to(conv_slots.dtype).unflatten(1, (-1, k1)).transpose(0, 1))
        return self._finish(core[0], z)


class ValidRows:
    """The valid rows of a padded pass as device tensors: ``mask`` ``[T]`` (True = a real token) and
    ``conv_index`` ``[kernel-1]`` (the window columns that become the new conv state)."""

    __slots__ = ("mask", "conv_index")

    def __init__(self, mask: torch.Tensor, conv_index: torch.Tensor) -> None:
        self.mask = mask
        self.conv_index = conv_index
