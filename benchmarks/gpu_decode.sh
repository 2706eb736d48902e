#!/usr/bin/env bash
# Decode through HTTP on one CUDA machine, as a user meets it: the 27B-width checkpoint (8 layers,
# transformers' own config) and its FP8 copy (`hpc-cli quantize`), each served by `hpc-cli serve`
# with decode steps built ahead and without (`HPC_ENGINE__DECODE_AHEAD`), the quick multi-turn trace
# of benchmarks/serve_trace.py streamed through the openai client with 64-token answers; then the
# GPU test of the decode path. A table of time per output token and decode tok/s prints last.
#
#   bash benchmarks/gpu_decode.sh OUT_DIR
#
# CKPT (default /tmp/q27) is where the checkpoints go (reused when there). About 6 minutes on an
# H200 with the checkpoint to write.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_decode.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh
CK=${CKPT:-/tmp/q27}
[ -f "$CK/config.json" ] || step checkpoint 300 python3 benchmarks/serve_trace.py --write-checkpoint "$CK" --shape 27b
[ -f "$CK-fp8/config.json" ] || step quantize 300 hpc-cli quantize "$CK" "$CK-fp8" --format fp8
for round in 1 2; do
    for w in bf16 fp8; do
        dir=$CK; [ $w = fp8 ] && dir=$CK-fp8
        for ahead in true false; do
            HPC_ENGINE__DECODE_AHEAD=$ahead step "serve-$w-ahead-$ahead-$round" 240 python3 benchmarks/serve_trace.py \
                --model "$dir" --quick --modes hybrid --concurrency 1 --max-tokens 64 \
                --serve-args '--kv-profile int8-g64 --prefill-chunk 2048' --out "$OUT/serve-$w-$ahead-$round.json"
        done
    done
done
[ "${TESTS:-1}" = 0 ] || step test 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_gpu.py -k built_ahead
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("serve-*.json")):
    _, w, ahead, rnd = f.stem.split("-")
    r = json.loads(f.read_text())["results"]["hybrid"]["1"]
    rows.setdefault((w, ahead), []).append(r["tpot_p50_s"])
base = statistics.median(rows.get(("bf16", "false"), [float("nan")]))
for (w, ahead), tpots in sorted(rows.items()):
    t = statistics.median(tpots)
    print(f"{w:5} decode_ahead={ahead:5}  TPOT p50 {1e3 * t:6.3f} ms  {1 / t:7.1f} tok/s  {base / t:5.2f}x bf16 in turn")
PY
summary
