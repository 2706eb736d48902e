#!/usr/bin/env bash
# The first decode gap after a hybrid prefill (#17's decode ratio at one request at a time), on one
# CUDA machine: benchmarks/decode_gaps.py once per variant, each in its own process (off, hybrid,
# hybrid with the transfer copies on the copy engines, hybrid with the write-through's copy launches
# on HPC_SEG_WRITE_PROGRAMS programs for each N in PROGRAMS), then the engine stacks that waited for
# the device, then one table of every gap against off's.
#
#   bash benchmarks/gpu_gaps.sh OUT_DIR [decode_gaps options, e.g. --turns 3]   # about 5 minutes
#
# Writes OUT_DIR/gaps-*.json (each run's document) and OUT_DIR/gaps.json (all of them merged by
# decode_gaps.py --compare); PROGRAMS (default "16 4") the programs tried.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_gaps.sh OUT_DIR [decode_gaps options]}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh

for v in off hybrid hybrid:dma; do
    step "gaps-${v/:/-}" 240 python3 benchmarks/decode_gaps.py --variants "$v" --label "${v/:/-}" \
        --out "$OUT/gaps-${v/:/-}.json" "$@"
done
for n in ${PROGRAMS:-16 4}; do
    step "gaps-hybrid-p$n" 240 env HPC_SEG_WRITE_PROGRAMS="$n" python3 benchmarks/decode_gaps.py \
        --variants hybrid --label "hybrid-p$n" --out "$OUT/gaps-hybrid-p$n.json" "$@"
done
step sync-debug 300 python3 benchmarks/decode_gaps.py --variants hybrid --label hybrid-sync --sync-debug \
    --out "$OUT/sync.json" "$@"
python3 benchmarks/decode_gaps.py --compare "$OUT"/gaps-*.json --out "$OUT/gaps.json" > /dev/null
summary
