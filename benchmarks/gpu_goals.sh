#!/usr/bin/env bash
# The open GPU goals' figures in one call on one CUDA machine (about 9 minutes), for a session
# whose device time is short: each issue's figure measured as its goal states it, a table last.
#
# * FP8 against bf16 decode at batch 1 (goal >= 1.5x on an H200): benchmarks/profile_decode.py on
#   the 27B-width checkpoint (8 layers) and its `hpc-cli quantize --format fp8` copy: the step's
#   graph (the device's own time) and the step as the engine runs it; and the FP8 graph with the
#   decode tile's waves at 8 (twice the K splits), to see whether the tile should change;
# * a tap's cost over a snapshot copy's device time (goal <= 1.1x): benchmarks/gdn_taps.py, a
#   tap in a 512-token pass and in a 2,048-token pass, and the prefill throughput with 8 taps in
#   8k tokens (goal >= 0.97);
# * a cached turn against the cache off through HTTP (goal TTFT p50 <= 0.3x): benchmarks/
#   serve_trace.py's multi-turn trace, hybrid and off in the same run, through `hpc-cli serve
#   --kv-profile int8-g64 --prefill-chunk 2048` and the openai client, at concurrency CONCURRENCY
#   (default 1; "1,8" adds the concurrent sessions, about 4 minutes more).
#
#   bash benchmarks/gpu_goals.sh OUT_DIR
#
# CK (default /tmp/ck) keeps the checkpoints between calls on a warm machine; logs go under LOGS
# (default /tmp/goals-logs), the three JSON documents under OUT_DIR. Each step has its own time
# limit and the script carries on after a failure. Needs the official openai client on that
# machine (see benchmarks/gpu_serve.sh).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
out_dirs gpu_goals.sh /tmp/goals-logs "${1:-}"
checkpoints "$CK"
step decode 150 python3 benchmarks/profile_decode.py --model "$CK/bf16" --model "$CK/fp8" --repeat 5 \
    --out "$OUTDIR/decode.json"
# the FP8 products with twice the K splits (the output products' split sums now cost no launch)
step decode-waves8 120 python3 benchmarks/profile_decode.py --model "$CK/fp8" --repeat 5 --tile fp8.waves=8 \
    --out "$OUTDIR/decode-waves8.json"
step taps 150 bash -c "python3 benchmarks/gdn_taps.py --repeat 10 > '$OUTDIR/taps.json'"
step serve 420 python3 benchmarks/serve_trace.py --model "$CK/bf16" --concurrency "${CONCURRENCY:-1}" \
    --serve-args "--kv-profile int8-g64 --prefill-chunk 2048" --log-dir "$OUT" --out "$OUTDIR/serve.json"
summary
python3 - "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


rows = []
dec = load("decode.json")
if dec:
    bf16, fp8 = dec["runs"][0], dec["runs"][1]
    rows.append(("FP8 / bf16 decode, graph (>= 1.5)", bf16["graph_ms"] / fp8["graph_ms"],
                 f"{bf16['graph_ms']:.3f} / {fp8['graph_ms']:.3f} ms, {dec['device']}"))
    rows.append(("FP8 / bf16 decode, engine step", bf16["engine_ms"] / fp8["engine_ms"],
                 f"{bf16['engine_ms']:.3f} / {fp8['engine_ms']:.3f} ms"))
    w8 = load("decode-waves8.json")
    if w8:
        rows.append(("FP8 / bf16 decode, graph, FP8 waves 8", bf16["graph_ms"] / w8["runs"][0]["graph_ms"],
                     f"{w8['runs'][0]['graph_ms']:.3f} ms (the shipped tile's waves: 4)"))
taps = load("taps.json")
if taps:
    for key, what in (("short_tap", "512-token pass"), ("pass_tap", "2,048-token pass")):
        rows.append((f"a tap / a copy's device time, {what} (<= 1.1)", taps[f"{key}_cost_over_copy_device"],
                     f"{taps[f'{key}_s'] * 1e6:.1f} / {taps['copy_device_s'] * 1e6:.1f} us"))
    rows.append(("prefill with 8 taps in 8k tokens (>= 0.97)", taps["in_pass_throughput"],
                 f"split passes {taps['split_throughput']:.3f}"))
serve = load("serve.json")
if serve:
    res = serve["results"]

    def ttft_ms(r):
        return None if not r.get("ttft_s") else r["ttft_s"]["p50"] * 1e3

    for pair, by_c in serve.get("ratios", {}).items():  # "hybrid/off": {"1": ratios, ...}
        mode, base = pair.split("/")
        for c, r in by_c.items():
            h, o = res[mode][c], res[base][c]
            rows.append((f"{pair} TTFT p50, c={c} (<= 0.3)", r["ttft_p50"],
                         f"{fmt(ttft_ms(h), '.1f')} / {fmt(ttft_ms(o), '.1f')} ms, reuse {fmt(h['reuse_share'])}"))
            rows.append((f"{pair} decode tok/s, c={c} (>= 0.98)", r["decode_tok_s_p50"],
                         f"answers equal {fmt(r['answers_equal_share'])}"))
width = max((len(r[0]) for r in rows), default=0)
for name, value, detail in rows:
    print(f"{name:<{width}}  {fmt(value):>6}  {detail}")
PY
