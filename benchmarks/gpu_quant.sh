#!/usr/bin/env bash
# Quantized weights held as stored, on one CUDA machine, in one go: the GPU tests of the kernels
# and of a held model, then the 27B-width checkpoint (8 layers, transformers' own config and
# safetensors) in bf16 against its FP8 and NVFP4 copies (`hpc-cli quantize`): prefill and decode
# throughput of each (benchmarks/model_throughput.py, ours only) and the weights each holds
# (`hpc-cli kv table --model DIR --device cuda`). With MERGE_AB=1 each format's throughput also
# runs with `--no-merge` (the projections multiplied apart), merged and apart taking turns twice.
# A summary prints last.
#
#   bash benchmarks/gpu_quant.sh OUT_DIR
#   MERGE_AB=1 bash benchmarks/gpu_quant.sh OUT_DIR
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_quant.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh
CK=${CK:-$(mktemp -d)}  # CK/bf16 is reused when it holds a checkpoint already
step tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/model/test_quant_linear.py tests/model/test_merged.py
[ -f "$CK/bf16/config.json" ] || step checkpoint 300 python3 benchmarks/serve_trace.py --write-checkpoint "$CK/bf16" --shape 27b
for fmt in fp8 nvfp4; do
    step "quantize-$fmt" 300 hpc-cli quantize "$CK/bf16" "$CK/$fmt" --format "$fmt"
done
for fmt in bf16 fp8 nvfp4; do
    step "kv-table-$fmt" 60 bash -c "hpc-cli kv table --model '$CK/$fmt' --device cuda --json > '$OUT/kv-$fmt.json'"
    step "throughput-$fmt" 300 python3 benchmarks/model_throughput.py --model "$CK/$fmt" --no-hf --batches 1,8 \
        --prefill 2048 --quantized-weights held --out "$OUT/throughput-$fmt.json"
done
if [ "${MERGE_AB:-0}" = 1 ]; then
    for round in 1 2; do
        for fmt in bf16 fp8; do
            for m in apart merged; do
                flag=""; [ $m = apart ] && flag="--no-merge"
                step "ab-$fmt-$m-$round" 300 python3 benchmarks/model_throughput.py --model "$CK/$fmt" --no-hf \
                    --batches 1,8 --prefill 2048 --quantized-weights held --repeat 3 $flag --out "$OUT/ab-$fmt-$m-$round.json"
            done
        done
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("ab-*.json")):
    print(f"{f.stem:22}", json.loads(f.read_text())["ours"])
PY
fi
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for fmt in ("bf16", "fp8", "nvfp4"):
    try:
        t = json.loads((out / f"throughput-{fmt}.json").read_text())
        w = json.loads((out / f"kv-{fmt}.json").read_text())["weights"]
    except (OSError, ValueError, KeyError) as exc:
        print(fmt, "missing:", exc)
        continue
    rows[fmt] = t["ours"]
    base = rows.get("bf16", t["ours"])
    print(f"{fmt:6} held {w['resident_bytes'] / 2**30:6.2f} GiB", "  ".join(
        f"{k} {v} ({v / base[k]:.2f}x bf16)" for k, v in t["ours"].items() if k in base))
PY
summary
