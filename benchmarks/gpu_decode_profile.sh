#!/usr/bin/env bash
# Decode at 27B widths, bf16 against FP8, on one CUDA machine: the GPU tests of the quantized
# products, then benchmarks/profile_decode.py (a step's host and device time, kernels by kind)
# with the shipped tiles and with each FP8 tile setting given in TILE_AB (e.g.
# "fp8.waves=8"), then benchmarks/model_throughput.py for both formats, bf16 and FP8
# taking turns ROUNDS times. With HTTP=1, decode as a user meets it: benchmarks/serve_trace.py's
# quick trace (cache off, HTTP_TOKENS tokens an answer, default 128) through `hpc-cli serve` for
# each format, with `[engine] send_after_launch` on (the default) and off. Logs under $LOGS
# (default /tmp/decode-logs); JSON documents under OUT_DIR; a table prints last.
#
#   TILE_AB="fp8.waves=8" ROUNDS=2 bash benchmarks/gpu_decode_profile.sh OUT_DIR
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
out_dirs gpu_decode_profile.sh /tmp/decode-logs "${1:-}"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    step tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/model/test_quant_linear.py
fi
checkpoints "$CK"
step profile 300 python3 benchmarks/profile_decode.py --model "$CK/bf16" --model "$CK/fp8" --out "$OUTDIR/profile.json"
i=0
for t in ${TILE_AB:-}; do
    i=$((i + 1))
    step "profile-ab$i" 300 python3 benchmarks/profile_decode.py --model "$CK/fp8" --tile "$t" --out "$OUTDIR/profile-ab$i.json"
done
for round in $(seq 1 "${ROUNDS:-0}"); do
    for fmt in bf16 fp8; do
        step "throughput-$fmt-$round" 300 python3 benchmarks/model_throughput.py --model "$CK/$fmt" --no-hf \
            --batches 1,8 --prefill 2048 --quantized-weights held --repeat 3 --out "$OUTDIR/throughput-$fmt-$round.json"
    done
done
if [ "${HTTP:-0}" = 1 ]; then
    for fmt in bf16 fp8; do
        for send in true false; do
            step "http-$fmt-send-$send" 400 env HPC_ENGINE__SEND_AFTER_LAUNCH=$send python3 benchmarks/serve_trace.py \
                --model "$CK/$fmt" --quick --concurrency 1 --modes off --max-tokens "${HTTP_TOKENS:-128}" \
                --serve-args "--kv-profile int8-g64 --prefill-chunk 2048" --out "$OUT/http-$fmt-send-$send.json"
        done
    done
fi
summary
python3 - "$OUTDIR" "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for f in sorted(out.glob("profile*.json")):
    doc = json.loads(f.read_text())
    for r in doc["runs"]:
        print(f"{f.stem:12} {Path(r['model']).name:5} tiles={doc['tiles']} loop {r['loop_ms']:.3f} engine {r['engine_ms']:.3f}"
              f" graph {r['graph_ms']:.3f} kernels {r['kernel_ms']:.3f} gaps {r['gaps_ms']:.3f} ms")
        print("   ", "  ".join(f"{k} {v:.3f}/{r['kinds_calls'][k]:.0f}" for k, v in r["kinds_ms"].items()))
rounds = {}
for f in sorted(out.glob("throughput-*.json")):
    _, fmt, rnd = f.stem.split("-")
    rounds.setdefault(rnd, {})[fmt] = json.loads(f.read_text())["ours"]
for rnd, r in sorted(rounds.items()):
    if "bf16" in r and "fp8" in r:
        print(f"round {rnd}: " + "  ".join(f"{k} {r['bf16'][k]:.1f}/{r['fp8'][k]:.1f} = {r['fp8'][k] / r['bf16'][k]:.3f}x"
                                        for k in r["bf16"]))
http = {}
for f in sorted(Path(sys.argv[2]).glob("http-*.json")):
    doc = json.loads(f.read_text())
    http[f.stem] = doc
    r = doc["results"]["off"]["1"]
    print(f"{f.stem:24} tpot p50 {r['tpot_p50_s'] * 1e3:.3f} ms  decode {r['decode_tok_s_p50']} tok/s  itl p50 {r['itl_p50_s'] * 1e3:.3f} ms")
if http:
    (out / "http.json").write_text(json.dumps(http, indent=1) + "\n")
PY
