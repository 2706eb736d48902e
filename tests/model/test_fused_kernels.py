"""hpc_kernels.rms_norm and hpc_kernels.gdn_decode: the fused norms and the fused GDN decode
column. On the CPU: the GDN column's torch twin against the model's own torch column (fp32), and
the kernels against their twins in Triton's interpreter (a child process: TRITON_INTERPRET is
read at import), also through the whole column pass (decode and verify with the kernels equal
each other bit for bit and the torch pass within bf16 rounding). On CUDA the same checks run
compiled (``-m gpu``)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from hpc_cli.model.layers import apply_rotary
from hpc_kernels import causal_conv, gdn_decode, rms_norm, swiglu
from hpc_kernels.split_sums import SplitSums

from .helpers import run_interpreted


def _layer_inputs(B: int, T: int, n_k: int, HV: int, K: int, V: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * n_k * K + HV * V
    win = torch.randn(B, C, 3 + T, generator=g).to(dtype)
    conv_w = (torch.randn(C, 4, generator=g) * 0.5).to(dtype)
    a = torch.randn(B * T, HV, generator=g).to(dtype)
    b = torch.randn(B * T, HV, generator=g).to(dtype)
    A_log = torch.rand(HV, generator=g).to(dtype)
    dt_bias = torch.randn(HV, generator=g).to(dtype)
    state = torch.randn(B, HV, K, V, generator=g) * 0.2
    return win, conv_w, a, b, A_log, dt_bias, state


def test_twin_equals_the_model_column_in_fp32():
    """The twin's conv, gates, norms and step are the model's own (hpc_cli.model.gdn's torch
    recurrence on the column's ops), here in fp32 where the rounding points do not matter."""
    import torch.nn.functional as F

    from hpc_cli.model.gdn import recurrent_rule

    B, n_k, HV, K, V = 2, 2, 4, 16, 8
    win, conv_w, a, b, A_log, dt_bias, state = _layer_inputs(B, 1, n_k, HV, K, V, torch.float32)
    o, S = gdn_decode.gdn_step_ref(win, 0, conv_w, a, b, A_log, dt_bias, state, n_k)
    conv = F.silu((win[:, :, 0:4] * conv_w).sum(-1))
    q, k, v = torch.split(conv, [n_k * K, n_k * K, HV * V], dim=-1)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    ro, rS = recurrent_rule(q.view(B, 1, n_k, K), k.view(B, 1, n_k, K), v.view(B, 1, HV, V), g.view(B, 1, HV),
                            b.sigmoid().view(B, 1, HV), state)
    assert torch.allclose(o, ro[:, 0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(S, rS, atol=1e-5, rtol=1e-4)


def test_conv_twin_equals_the_model_conv():
    """The fused conv's twin is the CPU path's time-major conv with its silu: the same sums in the
    same order and the same rounding points (the CPU path fuses its multiply-adds, so the fp32
    sums may differ in their last bit)."""
    import torch.nn.functional as F

    from hpc_cli.model.gdn import causal_conv_time_major

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        state = torch.randn(40, 3, generator=g).to(dtype)
        x = torch.randn(9, 40, generator=g).to(dtype)
        w = torch.randn(40, 1, 4, generator=g).to(dtype)
        model = F.silu(causal_conv_time_major(torch.cat([state.t(), x]), w)).to(dtype)
        got = causal_conv.conv_silu_ref(state, x, w[:, 0, :])
        assert _rel(got, model) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_conv_window_parts_give_the_columns_of_the_whole():
    from hpc_cli.model.gdn import ConvWindow

    state, rows = torch.randn(6, 3), torch.randn(10, 6)
    whole = ConvWindow(columns=torch.cat([state, rows.t()], dim=1))
    parts = ConvWindow(state=state, rows=rows)
    for idx in ([0, 1, 2], [2, 3, 4], [10, 11, 12], [4, 0, 12, 7]):
        i = torch.tensor(idx)
        assert torch.equal(parts.cols(i), whole.cols(i))
    for a, b in ((0, 3), (1, 4), (3, 6), (5, 13), (0, 13)):
        assert torch.equal(parts.span(a, b), whole.span(a, b))


def test_kernels_fall_back_to_the_twins_off_cuda():
    x = torch.randn(3, 5, 32)
    w = torch.randn(32)
    assert torch.equal(rms_norm.rms_norm(x, w, 1e-6), rms_norm.rms_norm_ref(x, w, 1e-6))
    z = torch.randn(3, 5, 32)
    assert torch.equal(rms_norm.gated_rms_norm(x, w, z, 1e-6), rms_norm.gated_rms_norm_ref(x, w, z, 1e-6))
    s, y = rms_norm.add_rms_norm(x, z, w, 1e-6)
    assert torch.equal(s, x + z) and torch.equal(y, rms_norm.rms_norm_ref(x + z, w, 1e-6))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _kernel_cases(device: str) -> dict:
    """Each kernel against its twin, on ``device`` (the interpreter's CPU, or CUDA)."""
    out: dict = {"norm": [], "step": [], "conv": [], "swiglu": [], "select": _select_cases(device),
                 "block": _block_cases(device), "dconv": _dconv_cases(device),
                 "ring": _ring_cases(device)}
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        # rows at a uniform stride inside a wider projection (q inside [query | gate])
        proj = torch.randn(5, 3, 2 * 64, generator=g).to(dtype).to(device)
        q = proj[..., :64]
        w = torch.randn(64, generator=g).to(dtype).to(device)
        z = torch.randn(15, 64, generator=g).to(dtype).to(device)
        x = torch.randn(15, 64, generator=g).to(dtype).to(device)
        wide = torch.randn(4, 320, generator=g).to(dtype).to(device)  # a dim that is not a power of two
        w320 = torch.randn(320, generator=g).to(dtype).to(device)
        cos = torch.randn(5, 16, generator=g).to(dtype).to(device)
        sin = torch.randn(5, 16, generator=g).to(dtype).to(device)
        # heads inside a merged product (k inside q|k|v, z inside qkv|z|b|a): a token stride wider
        # than the heads' own, read in place
        merged = torch.randn(5, 3 * 64 + 2 * 64 + 64, generator=g).to(dtype).to(device)
        k = merged[:, 3 * 64:5 * 64].view(5, 2, 64)
        zh = torch.randn(5, 2 * 3 * 64, generator=g).to(dtype).to(device)[:, 64:4 * 64].unflatten(-1, (3, 64))
        core = torch.randn(5, 3, 64, generator=g).to(dtype).to(device)
        parts = torch.randn(3, *x.shape, generator=g).to(device)
        out["norm"].append({
            "dtype": str(dtype), "compiled": device == "cuda",
            "merged_rope": _rel(rms_norm.rms_norm_rope(k, w, 1e-6, cos, sin),
                                apply_rotary(rms_norm.rms_norm_ref(k, w, 1e-6), cos, sin)),
            "merged_gated": _rel(rms_norm.gated_rms_norm(core, w, zh, 1e-6), rms_norm.gated_rms_norm_ref(core, w, zh, 1e-6)),
            "merged_in_place": bool(torch.equal(rms_norm.rms_norm_rope(k, w, 1e-6, cos, sin),
                                                rms_norm.rms_norm_rope(k.contiguous(), w, 1e-6, cos, sin))
                                    and torch.equal(rms_norm.gated_rms_norm(core, w, zh, 1e-6),
                                                    rms_norm.gated_rms_norm(core, w, zh.contiguous(), 1e-6))),
            "rope": _rel(rms_norm.rms_norm_rope(q, w, 1e-6, cos, sin), apply_rotary(rms_norm.rms_norm_ref(q, w, 1e-6), cos, sin)),
            "strided": _rel(rms_norm.rms_norm(q, w, 1e-6), rms_norm.rms_norm_ref(q, w, 1e-6)),
            "wide": _rel(rms_norm.rms_norm(wide, w320, 1e-6), rms_norm.rms_norm_ref(wide, w320, 1e-6)),
            "gated": _rel(rms_norm.gated_rms_norm(x, w, z, 1e-6), rms_norm.gated_rms_norm_ref(x, w, z, 1e-6)),
            "rows_alone": bool(torch.equal(rms_norm.rms_norm(q[1:2], w, 1e-6), rms_norm.rms_norm(q, w, 1e-6)[1:2])),
            # the residual sum and its norm in one launch: the sum as torch rounds it, the norm of it
            "add_sum_exact": bool(torch.equal(rms_norm.add_rms_norm(x, z, w, 1e-6)[0], x + z)),
            # a product's split sums as the residual: added in order in the launch, rounded to the
            # rows' dtype as the product rounds its sum (exact where no rounding is involved: fp32,
            # or compiled; the interpreter truncates fp32 to bf16 where torch rounds)
            "add_split_sums": bool(all(torch.equal(a, b) for a, b in zip(
                rms_norm.add_rms_norm(x, SplitSums(parts, x.dtype), w, 1e-6),
                rms_norm.add_rms_norm(x, SplitSums(parts, x.dtype).total(), w, 1e-6)))),
            "add_split_sums_ref": bool(all(torch.equal(a, b) for a, b in zip(
                rms_norm.add_rms_norm_ref(x, SplitSums(parts, x.dtype), w, 1e-6),
                rms_norm.add_rms_norm_ref(x, SplitSums(parts, x.dtype).total(), w, 1e-6)))),
            # rows of any leading shape (here [5, 3, 64]) are the tokens
            "add_any_shape": bool(all(torch.equal(a, b.view(5, 3, 64)) for a, b in zip(
                rms_norm.add_rms_norm(core, core.flip(0), w, 1e-6),
                rms_norm.add_rms_norm(core.reshape(15, 64), core.flip(0).reshape(15, 64), w, 1e-6)))),
            "add": _rel(rms_norm.add_rms_norm(wide, wide.flip(0), w320, 1e-6)[1],
                        rms_norm.rms_norm_ref(wide + wide.flip(0), w320, 1e-6)),
            "add_equals_norm_of_sum": bool(torch.equal(rms_norm.add_rms_norm(x, z, w, 1e-6)[1],
                                                       rms_norm.rms_norm(rms_norm.add_rms_norm(x, z, w, 1e-6)[0],
                                                                         w, 1e-6))),
        })
        for T in (1, 2, 37):  # fewer rows than the conv's width; rows past one tile
            st = torch.randn(200, 3, generator=g).to(dtype).to(device)
            x = torch.randn(T, 2 * 200, generator=g).to(dtype).to(device)[:, :200]  # rows at a wider stride
            cw = torch.randn(200, 4, generator=g).to(dtype).to(device)
            out["conv"].append({"dtype": str(dtype), "T": T,
                                "rel": _rel(causal_conv.conv_silu(st, x, cw), causal_conv.conv_silu_ref(st, x, cw))})
        gate = torch.randn(3, 2 * 3000, generator=g).to(dtype).to(device)[:, :3000]
        up = torch.randn(3, 3000, generator=g).to(dtype).to(device)
        out["swiglu"].append({"dtype": str(dtype), "rel": _rel(swiglu.swiglu(gate, up), swiglu.swiglu_ref(gate, up))})
        B, T, n_k, HV, K, V = 2, 3, 2, 4, 32, 64
        win, conv_w, a, b, A_log, dt_bias, state = (t.to(device) for t in _layer_inputs(B, T, n_k, HV, K, V, dtype))
        slots = torch.zeros(5, HV, K, V, device=device)
        lanes = torch.tensor([3, 1], device=device)
        slots[lanes] = state
        kept = torch.zeros(B * T, HV, K, V, device=device)
        # rows past B * T: the pass's padding to a row block, zeroed by the last column's launch
        o_rows = torch.full((B * T + 3, HV, V), 7.0, dtype=dtype, device=device)
        # the verify form: column t's state in row b*T+t of kept
        for t in range(T):
            src, idx = (slots, lanes) if t == 0 else (kept, None)
            gdn_decode.gdn_step(win, t, conv_w, a, b, A_log, dt_bias, src, idx, kept, None, n_k, T, o_rows)
        o = o_rows[:B * T]
        # every column in one launch, and in two (the second reading its state from the kept
        # rows): the same bits as a launch a column, the padding zero
        kept1, o1 = torch.zeros_like(kept), torch.full_like(o_rows, 7.0)
        gdn_decode.gdn_step(win, 0, conv_w, a, b, A_log, dt_bias, slots, lanes, kept1, None, n_k, T, o1, columns=T)
        kept2, o2_rows = torch.zeros_like(kept), torch.full_like(o_rows, 7.0)
        gdn_decode.gdn_step(win, 0, conv_w, a, b, A_log, dt_bias, slots, lanes, kept2, None, n_k, T, o2_rows)
        gdn_decode.gdn_step(win, 1, conv_w, a, b, A_log, dt_bias, kept2, None, kept2, None, n_k, T, o2_rows,
                            columns=T - 1)
        # the in-place form over T columns: the slot ends with the last column's state
        slots3 = slots.clone()
        o3 = torch.full_like(o_rows, 7.0)
        gdn_decode.gdn_step(win, 0, conv_w, a, b, A_log, dt_bias, slots3, lanes, slots3, lanes, n_k, T, o3, columns=T)
        one_launch = (torch.equal(kept1, kept) and torch.equal(o1, o_rows) and torch.equal(kept2, kept)
                      and torch.equal(o2_rows, o_rows) and torch.equal(o3, o_rows)
                      and torch.equal(slots3[lanes], kept.view(B, T, HV, K, V)[:, -1])
                      and torch.equal(slots3[[0, 2, 4]], slots[[0, 2, 4]]))
        ref_S, ref_o, ref_kept = state, [], []
        for t in range(T):
            ro, ref_S = gdn_decode.gdn_step_ref(win, t, conv_w, a.view(B, T, HV)[:, t], b.view(B, T, HV)[:, t],
                                                A_log, dt_bias, ref_S, n_k)
            ref_o.append(ro)
            ref_kept.append(ref_S)
        ref_o = torch.stack(ref_o, 1).reshape(B * T, HV, V)
        ref_kept = torch.stack(ref_kept, 1).reshape(B * T, HV, K, V)
        # the decode form, in place in the slots: column by column equals the verify form bit for bit
        dec_o = torch.empty(B, HV, V, dtype=dtype, device=device)
        same = True
        for t in range(T):
            wt = win[:, :, t:t + 4].contiguous()  # decode's window: the conv state, then the column
            gdn_decode.gdn_step(wt, 0, conv_w, a.view(B, T, HV)[:, t].contiguous(), b.view(B, T, HV)[:, t].contiguous(),
                                A_log, dt_bias, slots, lanes, slots, lanes, n_k, 1, dec_o)
            same &= bool(torch.equal(dec_o, o.view(B, T, HV, V)[:, t]))
            same &= bool(torch.equal(slots[lanes], kept.view(B, T, HV, K, V)[:, t]))
        # decode's two launches, both states stepped in their slots: column 0 of the same window
        # (the conv state, then the projections at a wider row stride), equal to the window's
        # kernel bit for bit, the conv state shifted by the new column, 3 padding rows zero
        C = win.shape[1]
        conv_slots = torch.zeros(5, C, 3, dtype=dtype, device=device)
        conv_slots[lanes] = win[:, :, :3]
        x_rows = torch.zeros(B + 3, 2 * C, dtype=dtype, device=device)
        x_rows[:B, :C] = win[:, :, 3]
        rec = torch.zeros(5, HV, K, V, device=device)
        rec[lanes] = state
        o2 = torch.full((B + 3, HV, V), 7.0, dtype=dtype, device=device)
        gdn_decode.gdn_decode_step(x_rows[:, :C], conv_slots, lanes, conv_w, a.view(B, T, HV)[:, 0],
                                   b.view(B, T, HV)[:, 0], A_log, dt_bias, rec, n_k, o2)
        in_place = (bool(torch.equal(o2[:B], o.view(B, T, HV, V)[:, 0]))
                    and bool(torch.equal(rec[lanes], kept.view(B, T, HV, K, V)[:, 0]))
                    and bool(torch.equal(conv_slots[lanes], win[:, :, 1:4])) and bool((o2[B:] == 0).all())
                    and bool((rec[[0, 2, 4]] == 0).all()) and bool((conv_slots[[0, 2, 4]] == 0).all()))
        # the verify pass's windows in one launch: the lanes' conv states, then the columns'
        # projections (rows at a wider stride), the values of torch's gather and concatenation
        proj = torch.randn(B * T, 2 * C, generator=g).to(dtype).to(device)[:, :C]
        window = gdn_decode.conv_window(conv_slots, lanes, proj, T, torch.full((B, C, 3 + T), 7.0, dtype=dtype,
                                                                              device=device))
        ref_window = torch.cat([conv_slots.index_select(0, lanes), proj.reshape(B, T, C).transpose(1, 2)], -1)
        out["step"].append({"dtype": str(dtype), "o": _rel(o, ref_o), "states": _rel(kept, ref_kept),
                            "window_exact": bool(torch.equal(window, ref_window)),
                            "decode_equals_verify": same, "in_slots_equals_window": in_place,
                            "columns_in_one_launch": bool(one_launch),
                            "others_untouched": bool((slots[[0, 2, 4]] == 0).all()),
                            "padding_zero": bool((o_rows[B * T:] == 0).all())})
    return out


def _select_cases(device: str) -> dict:
    """DFlash2's candidate selector in one launch against its twin (the same candidates, the same
    fp32 sums) and against the drafter's torch ops (a top-k, the two products in bf16): rows read
    at a stride, a vocabulary that is not a power of two, an embedding with more rows than the
    logits, rows whose logits all tie (the candidates are then the smallest indices)."""
    import torch.nn.functional as F

    from hpc_kernels import candidate_select

    g = torch.Generator().manual_seed(3)
    out = {}
    for name, (N, V, H, R, C) in {"tiny": (6, 6144, 256, 64, 8), "odd": (3, 1000, 96, 20, 5)}.items():
        wide = torch.randn(N, V + 7, generator=g).to(torch.bfloat16).to(device)
        logits = wide[:, :V]  # rows at a stride wider than the vocabulary
        hid = torch.randn(N, H, generator=g).to(torch.bfloat16).to(device)
        wa = (torch.randn(R, H, generator=g) * 0.1).to(torch.bfloat16).to(device)
        wb = (torch.randn(R, H, generator=g) * 0.1).to(torch.bfloat16).to(device)
        emb = torch.randn(V + 5, H, generator=g).to(torch.bfloat16).to(device)
        got = candidate_select.select(logits, hid, wa, wb, emb, C, R ** -0.5)
        twin = candidate_select.select_ref(logits, hid, wa, wb, emb, C, R ** -0.5)
        top = logits.topk(C, dim=-1)
        dot = torch.matmul(F.linear(F.embedding(top.indices, emb), wb), F.linear(hid, wa)[..., None])[..., 0]
        score = torch.add(top.values.float(), dot.float(), alpha=R ** -0.5)
        ops = top.indices.gather(-1, score.argmax(-1, keepdim=True))
        tied = torch.zeros(2, V, dtype=torch.bfloat16, device=device)
        got_tied = candidate_select.select(tied, hid[:2], wa, wb, emb, C, R ** -0.5)
        out[name] = {"equals_twin": bool(torch.equal(got, twin)),
                     "same_as_ops": float((got == ops[:, 0]).float().mean()),
                     "rescored": bool((got != logits.float().argmax(-1)).any()),
                     "tied_equals_twin": bool(torch.equal(got_tied, candidate_select.select_ref(
                         tied, hid[:2], wa, wb, emb, C, R ** -0.5))),
                     "tied_in_first": bool((got_tied < C).all())}
    return out


def _block_cases(device: str) -> list:
    """A draft block's attention in one launch against its twin (the context gathered, masked,
    concatenated, torch's attention): DFlash's pages through a page table (rows inside wider
    planes), DFlash2's rings (one page a lane, lanes at, below and past the window), blocks of 1 and
    3 columns, grouped queries, a lane at position 0 (its block alone); a lane's context walked by
    one program and shared among three."""
    from hpc_kernels import block_attention as ba

    g = torch.Generator().manual_seed(4)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(bf).to(device)

    out = []
    for layout, T, Hq, KV, D in (("ring", 1, 8, 4, 32), ("ring", 3, 8, 4, 32), ("pages", 1, 4, 2, 64),
                                 ("pages", 3, 4, 2, 64)):
        if layout == "ring":
            rings = rnd(5, 2, 2, 96, KV, D)  # [slots, layers, K|V, window, kv, d]
            kc, vc = rings[:, 1, 0], rings[:, 1, 1]
            table = torch.tensor([3, 0, 4, 1], device=device)[:, None]
            S, pos = 96, torch.tensor([10, 200, 96, 0], device=device)
        else:
            kc, vc = rnd(12, 16, KV, 2 * D)[..., :D], rnd(12, 16, KV, 2 * D)[..., :D]  # rows inside wider planes
            table = torch.tensor([[3, 5, 7], [0, 1, 2], [11, 10, 9], [4, 6, 8]], device=device)
            S, pos = 48, torch.tensor([40, 17, 0, 48], device=device)
        B = pos.shape[0]
        q, kb = rnd(B * T, Hq, D), rnd(B * T, KV, D)
        vb = rnd(B * T, 3 * KV * D)[:, KV * D:2 * KV * D].view(B * T, KV, D)  # v inside a merged product
        twin = ba.block_attention_ref(q, kb, vb, kc, vc, table, kc.shape[1], pos, S)
        for splits in (1, 3):  # one program a lane, and a lane's context shared among three (then combined)
            got = ba.block_attention(q, kb, vb, kc, vc, table, kc.shape[1], pos, S, block_n=16, splits=splits)
            out.append({"layout": layout, "T": T, "splits": splits, "rel": _rel(got, twin)})
        out.append({"layout": layout, "T": T, "splits": "default",
                    "rel": _rel(ba.block_attention(q, kb, vb, kc, vc, table, kc.shape[1], pos, S), twin)})
    return out


def _dconv_cases(device: str) -> list:
    """DFlash2's dynamic convolution in one launch against its twin: blocks of 1 and 3 columns
    (each block's first column mixes with nothing before it), rows inside a wider product, a
    width that is not a power of two."""
    from hpc_kernels import dynamic_conv

    g = torch.Generator().manual_seed(8)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for B, T, H in ((3, 1, 256), (2, 3, 256), (2, 3, 96)):
            x = torch.randn(B, T, 2 * H, generator=g).to(dtype).to(device)[..., :H]
            w = torch.randn(2, H, generator=g).to(dtype).to(device) * 0.2
            got, twin = dynamic_conv.dynamic_conv(x, w), dynamic_conv.dynamic_conv_ref(x, w)
            first = dynamic_conv.dynamic_conv(x[:, :1], w)
            out.append({"dtype": str(dtype), "T": T, "H": H, "rel": _rel(got, twin),
                        "first_column_alone": bool(torch.equal(first[:, 0], got[:, 0]))})
    return out


def _ring_cases(device: str) -> list:
    """DFlash2's ring catch-up in one launch against its twin: both leave the same rings and save
    the same old rows (lanes that keep 0, some and all of their columns, positions that wrap round
    the window, v inside a merged product); the other layer, slots and ring rows untouched."""
    from hpc_kernels import ring_write

    g = torch.Generator().manual_seed(9)
    out = []
    for B, T in ((3, 1), (3, 3)):
        rings = torch.randn(5, 2, 2, 16, 2, 32, generator=g).to(torch.bfloat16).to(device)
        slots = torch.tensor([4, 0, 2], device=device)
        seqlens = torch.tensor([[15, 16, 17], [3, 4, 5], [30, 31, 32]], device=device)[:, :T]
        counts = torch.tensor([0, 2, 3], device=device).clamp(max=T)
        k = torch.randn(B * T, 2, 32, generator=g).to(torch.bfloat16).to(device)
        v = torch.randn(B * T, 3 * 64, generator=g).to(torch.bfloat16).to(device)[:, 64:128].view(B * T, 2, 32)
        res = []
        for fn in (ring_write.ring_write, ring_write.ring_write_ref):
            r, saved = rings.clone(), torch.zeros(B, T, 2, 2, 2, 32, dtype=torch.bfloat16, device=device)
            fn(r, 1, slots, seqlens, counts, k, v, saved)
            res.append((r, saved))
        (r1, s1), (r2, s2) = res
        out.append({"T": T, "rings_equal": bool(torch.equal(r1, r2)),
                    "saved_equal": bool(torch.equal(s1[:, :, 1], s2[:, :, 1])),
                    "layer0_untouched": bool(torch.equal(r1[:, 0], rings[:, 0])),
                    "changed": bool(not torch.equal(r1, rings))})
    return out


def _check_kernel_cases(cases: dict) -> None:
    for c in cases["ring"]:
        assert c["rings_equal"] and c["saved_equal"] and c["layer0_untouched"] and c["changed"], c
    for c in cases["dconv"]:
        assert c["rel"] < (1e-5 if "float32" in c["dtype"] else 2e-2) and c["first_column_alone"], c
    for c in cases["block"]:
        assert c["rel"] < 2e-2, c
    for name, c in cases["select"].items():
        assert c["equals_twin"] and c["tied_equals_twin"] and c["tied_in_first"], (name, c)
        assert c["same_as_ops"] >= 0.6 and c["rescored"], (name, c)
    for c in cases["norm"]:
        tol = 1e-6 if "float32" in c["dtype"] else 2e-2
        assert max(c["strided"], c["wide"], c["gated"], c["rope"], c["merged_rope"], c["merged_gated"], c["add"]) < tol, c
        assert c["rows_alone"] and c["merged_in_place"] and c["add_equals_norm_of_sum"] and c["add_any_shape"], c
        # Triton's interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest as torch
        assert c["add_sum_exact"] or not (c["compiled"] or "float32" in c["dtype"]), c
        assert c["add_split_sums"] or not (c["compiled"] or "float32" in c["dtype"]), c
        assert c["add_split_sums_ref"], c
    for c in cases["conv"] + cases["swiglu"]:
        assert c["rel"] < (1e-6 if "float32" in c["dtype"] else 2e-2), c
    for c in cases["step"]:
        tol = 1e-5 if "float32" in c["dtype"] else 2e-2
        assert max(c["o"], c["states"]) < tol, c
        assert c["decode_equals_verify"] and c["others_untouched"] and c["padding_zero"] and c["window_exact"], c
        assert c["in_slots_equals_window"], c
        assert c["columns_in_one_launch"], c


def _model_case(device: str) -> dict:
    """The column pass of builtin:random with the kernels against the torch ops: decode, then a
    3-column verify from the same state (every column equals decode's bit for bit). A model per
    mode: on CUDA decode replays graphs captured with the kernels of their mode."""
    from hpc_cli.model import layers
    from hpc_cli.model.columns import columns_pass
    from hpc_cli.model.model import HybridModel

    prompt = list(range(5, 70))
    nxt = [7, 9, 11]
    res, first = {}, {}
    try:
        for mode in (False, True):
            layers.FUSED_KERNELS = mode
            model = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device=device)
            kv = model.new_kv_storage("bf16", 8)
            states = model.new_state_slots(3)
            first[mode] = model.prefill(prompt, 0, [0, 1], 0, kv, states).logits.float()
            states.copy_slot(0, 1)
            dec = []
            for j, tok in enumerate(nxt):
                dec.append(model.decode([tok], [len(prompt) + j], [[0, 1]], [1], kv, states)[0].float())
            states.copy_slot(0, 2)
            ver = columns_pass(model, torch.tensor([nxt]), [len(prompt)], [[0, 1]], [2], kv, states, keep_all=True)
            res[mode] = (torch.stack(dec), ver.logits[0].float())
    finally:
        layers.FUSED_KERNELS = True
    dec_f, ver_f = res[True]
    dec_t, _ = res[False]
    return {"verify_equals_decode": bool(torch.equal(dec_f, ver_f)), "fused_vs_torch": _rel(dec_f, dec_t),
            "prefill_fused_vs_torch": _rel(first[True], first[False]),
            "same_top1": bool(torch.equal(dec_f.argmax(-1), dec_t.argmax(-1)))}


def _drafter_case(device: str) -> dict:
    """builtin:tiny's DFlash and DFlash2 block forward (merged products, the rope norms, the
    residual sums in the norms' launches) with the fused kernels against the torch ops, at k = 1
    (the one-column block) and k = 3, over a made-up context of 40 positions read below each
    lane's position: the final hidden within bf16 rounding and the drafts, mostly, alike."""
    from types import SimpleNamespace

    from hpc_cli.model import layers
    from hpc_cli.model.builtin import TINY_DIR
    from hpc_cli.model.model import HybridModel
    from hpc_cli.speculative.dflash import DFlashDrafter, DraftContext, load_drafter

    model = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(5)
    H = model.config.hidden_size
    out = {}
    try:
        for kind in ("dflash", "dflash2"):
            net = load_drafter(str(TINY_DIR / kind), kind, device, torch.bfloat16)
            d = DFlashDrafter(model, net)
            c = net.cfg
            d.states = SimpleNamespace(hidden=torch.randn(4, H, generator=g).to(torch.bfloat16).to(device))
            ctx = [tuple(torch.randn(3, c.num_kv_heads, 40, c.head_dim, generator=g).to(torch.bfloat16).to(device)
                         for _ in range(2)) for _ in range(c.num_layers)]
            nxt = torch.tensor([7, 300, 41], device=device)
            pos = torch.tensor([12, 40, 27], device=device)
            slots = torch.tensor([2, 0, 3], device=device)
            for k in (1, 3):
                hid, drafts = {}, {}
                for mode in (True, False):
                    layers.FUSED_KERNELS = mode
                    hid[mode] = d._block_hidden(nxt, pos, k, lambda l: DraftContext.of_dense(*ctx[l]), slots)
                    drafts[mode] = d._drafts(hid[mode])
                out[f"{kind}_k{k}"] = {"fused_vs_torch": _rel(hid[True].float(), hid[False].float()),
                                       "same_drafts": float((drafts[True] == drafts[False]).float().mean())}
    finally:
        layers.FUSED_KERNELS = True
    return out


def _check_drafter_case(cases: dict) -> None:
    assert set(cases) == {"dflash_k1", "dflash_k3", "dflash2_k1", "dflash2_k3"}, cases
    for name, c in cases.items():
        assert c["fused_vs_torch"] < 5e-2, (name, c)
        assert c["same_drafts"] >= 0.6, (name, c)


def _child() -> dict:
    return {"kernels": _kernel_cases("cpu"), "model": _model_case("cpu"), "drafter": _drafter_case("cpu")}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_interpreted_kernels_equal_the_twins():
    got = run_interpreted("tests.model.test_fused_kernels", timeout=900)
    _check_kernel_cases(got["kernels"])
    m = got["model"]
    assert m["verify_equals_decode"], m
    assert m["fused_vs_torch"] < 5e-2 and m["prefill_fused_vs_torch"] < 5e-2 and m["same_top1"], m
    _check_drafter_case(got["drafter"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_equal_the_twins():
    cases = _kernel_cases("cuda")
    m = _model_case("cuda")
    drafter = _drafter_case("cuda")
    print(json.dumps({"kernels": cases, "model": m, "drafter": drafter}))
    _check_kernel_cases(cases)
    _check_drafter_case(drafter)
    assert m["verify_equals_decode"], m
    assert m["fused_vs_torch"] < 5e-2 and m["prefill_fused_vs_torch"] < 5e-2 and m["same_top1"], m


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    print(json.dumps(_child()))
