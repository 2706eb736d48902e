"""Prefill passes as the engine runs them: warm-up cost, compilations after it, and pass times with
the paged prefill attention kernel against the gather + SDPA path, same model and pools, one run.

A component benchmark (it explains serving figures; ``benchmarks/serve_trace.py`` proves them):

* ``warmup``: seconds of ``Engine.warmup`` and the Triton compilations / autotune runs it did;
* ``after_warmup``: compilations and autotune runs while running ``--lengths`` prefill passes of
  distinct random lengths at random starts (the goal is 0), and which kernels they were;
* ``passes``: median seconds of a cold prompt (``--cold`` tokens in chunks of ``--chunk``) and of
  a cached turn (``--turn`` new tokens after ``--context`` cached ones), paged vs gathered;
* ``attention``: the attention of one cached turn alone, paged kernel vs gather + SDPA;
* ``gdn``: fla's chunk kernel with grouped q/k heads passed as they are vs repeated to the value
  heads (the runtime's path today), if fla is importable.

    python benchmarks/prefill.py --model builtin:qwen3.5-27b-shape@8 --kv-profile int8-g64
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median(fn, repeat: int = 5) -> float:
    fn()
    _sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _passes(model, kv, states, total: int, start: int, chunk: int) -> None:
    table = list(range(-(-(start + total) // 64)))
    pos = start
    while pos < start + total:
        n = min(chunk, start + total - pos)
        model.prefill(list(range(1, n + 1)), pos, table, 0, kv, states)
        pos += n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:qwen3.5-27b-shape@8")
    ap.add_argument("--kv-profile", default="int8-g64")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--cold", type=int, default=5120)
    ap.add_argument("--context", type=int, default=4800)
    ap.add_argument("--turn", type=int, default=500)
    ap.add_argument("--lengths", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from hpc_cli.engine.engine import Engine
    from hpc_cli.model import HybridModel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = HybridModel.from_name_or_path(a.model, device=dev, dtype=torch.bfloat16 if dev == "cuda" else None)
    built = time.perf_counter() - t0
    eng = Engine(model, kv_profile=a.kv_profile, prefill_chunk=a.chunk, max_concurrency=4,
                 max_model_len=a.max_model_len, kv_pages=a.max_model_len // 64 * 6)
    counts = eng.compile_counts
    c0, t0_ = counts.compilations, counts.autotunes
    warm = eng.warmup()
    res: dict = {"machine": {"device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
                             "torch": torch.__version__},
                 "model": a.model, "kv_profile": a.kv_profile, "chunk": a.chunk, "build_s": round(built, 2),
                 "warmup": {"seconds": round(warm, 2), "compilations": counts.compilations - c0,
                            "autotunes": counts.autotunes - t0_,
                            "shapes": (eng.warmup_report and {k: round(getattr(eng.warmup_report, k), 2)
                                                              for k in ("first_prefill_s", "prefill_s", "decode_s")})}}
    eng.stop()

    kv, states = eng.storage, eng.states
    rng = random.Random(7)
    c1, a1 = counts.compilations, counts.autotunes
    seen = []
    for _ in range(a.lengths):
        n = rng.randrange(1, a.chunk + 1)
        start = rng.randrange(0, a.max_model_len - n - 64)
        table = [(i * 7) % kv.num_pages for i in range(-(-(start + n) // 64))]
        model.prefill(list(range(1, n + 1)), start, table, 0, kv, states)
        seen.append(n)
    _sync()
    res["after_warmup"] = {"lengths": seen, "compilations": counts.compilations - c1,
                           "autotunes": counts.autotunes - a1,
                           "by_kernel": dict(counts.after_warm)}

    paged = kv.paged_attention_supported(model.config.num_attention_heads)
    timings = {}
    for label, force_gather in (("paged", False), ("gathered", True)):
        if label == "paged" and not paged:
            continue
        if force_gather:
            kv.paged_attention_supported = lambda heads: False  # this instance only
        cold = _median(lambda: _passes(model, kv, states, a.cold, 0, a.chunk), 3)
        turn = _median(lambda: _passes(model, kv, states, a.turn, a.context, a.chunk), 5)
        timings[label] = {"cold_s": round(cold, 5), "turn_s": round(turn, 5),
                          "cold_tok_s": round(a.cold / cold), "turn_tok_s": round(a.turn / turn)}
        if force_gather:
            del kv.paged_attention_supported
    if "paged" in timings:
        timings["turn_ratio_paged_over_gathered"] = round(timings["paged"]["turn_s"] / timings["gathered"]["turn_s"], 3)
        timings["cold_ratio_paged_over_gathered"] = round(timings["paged"]["cold_s"] / timings["gathered"]["cold_s"], 3)
    res["passes"] = timings
    if dev == "cuda":
        from torch.profiler import ProfilerActivity, profile

        _passes(model, kv, states, a.turn, a.context, a.chunk)
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                _passes(model, kv, states, a.turn, a.context, a.chunk)
            _sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        with open(a.out + ".profile.txt" if a.out else "prefill.profile.txt", "w") as f:
            f.write(table)
            f.write("\n\nby CPU time\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))

    if paged and dev == "cuda":
        import triton.testing

        from hpc_cli.model.attention import prefill_attention

        attn = next(l.self_attn for l in model.layers if l.kind != "linear_attention")
        H, d = attn.n_heads, attn.head_dim
        end = a.context + a.turn
        table = torch.arange(-(-end // 64), device=dev)
        q = torch.randn(a.turn, H, d, device=dev, dtype=torch.bfloat16)
        kk = torch.randn(end, kv.kv_heads, d, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(end, device=dev)
        kv.write(0, table[pos // 64] * 64 + pos % 64, kk, kk)
        t_paged = triton.testing.do_bench(lambda: kv.prefill_attention(0, q, table, a.context, attn.scale),
                                          return_mode="median")
        t_gather = triton.testing.do_bench(lambda: prefill_attention(attn, q, kv, 0, table, a.context),
                                           return_mode="median")
        ref = prefill_attention(attn, q, kv, 0, table, a.context).float()
        got = kv.prefill_attention(0, q, table, a.context, attn.scale).float()
        flops = 4 * H * d * a.turn * (a.context + a.turn / 2)
        res["attention"] = {"paged_ms": round(t_paged, 4), "gathered_ms": round(t_gather, 4),
                            "ratio": round(t_paged / t_gather, 3), "paged_tflops": round(flops / t_paged / 1e9, 1),
                            "rel_err": ((got - ref).norm() / ref.norm()).item()}

    from hpc_cli.model.gdn import _fla

    if dev == "cuda" and _fla() is not None:
        import triton.testing

        chunk_fn = _fla()[0]
        la = next(l.linear_attn for l in model.layers if l.kind == "linear_attention")
        T = a.chunk
        q = torch.randn(1, T, la.n_k, la.d_k, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, T, la.n_k, la.d_k, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, T, la.n_v, la.d_v, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(1, T, la.n_v, device=dev).float() * 0.1
        beta = torch.rand(1, T, la.n_v, device=dev).to(torch.bfloat16)
        h0 = torch.randn(1, la.n_v, la.d_k, la.d_v, device=dev) * 0.01
        rep = la.n_v // la.n_k

        def repeated():
            return chunk_fn(q=q.repeat_interleave(rep, 2), k=k.repeat_interleave(rep, 2), v=v, g=g, beta=beta,
                            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

        def grouped():
            return chunk_fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)

        gdn = {"tokens": T}
        try:
            o1, s1 = repeated()
            o2, s2 = grouped()
            gdn["grouped_rel_err_out"] = ((o2.float() - o1.float()).norm() / o1.float().norm()).item()
            gdn["grouped_rel_err_state"] = ((s2 - s1).norm() / s1.norm()).item()
            gdn["repeated_ms"] = round(triton.testing.do_bench(repeated, return_mode="median"), 4)
            gdn["grouped_ms"] = round(triton.testing.do_bench(grouped, return_mode="median"), 4)
        except Exception as exc:  # an fla release without grouped heads
            gdn["grouped_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["gdn"] = gdn

    doc = json.dumps(res, indent=1)
    print(doc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(doc)


if __name__ == "__main__":
    main()
