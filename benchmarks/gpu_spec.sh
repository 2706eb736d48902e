#!/usr/bin/env bash
# Speculative decoding on one CUDA machine after a change to the drafters' CUDA paths: the GPU
# tests of the draft graphs and round tails, then `benchmarks/spec_decode.py` on builtin:tiny's
# own chat traffic at k = 3 and 1 (none, MTP, DFlash, DFlash2 and any DRAFTERS sets in the same
# run), then `benchmarks/serve_spec.py` through HTTP with the official client. A table prints last.
#
#   bash benchmarks/gpu_spec.sh OUT_DIR
#
# DRAFTERS: extra drafter sets for spec_decode, "label=DIR ..." (DIR holding dflash/ and dflash2/);
# TESTS: 1 (default) the draft-graph tests, all the whole GPU file of speculative tests, 0 none.
# About 5 minutes on an H200 with the default tests (TESTS=all: run it with fewer steps after).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_spec.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh
case "${TESTS:-1}" in
    0) ;;
    all) step test 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_bf16_gpu.py ;;
    *) step test 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_bf16_gpu.py \
        -k "graph_drafts or warmup_covers_serving" ;;
esac
extra=()
for d in ${DRAFTERS:-}; do extra+=(--drafters "$d"); done
for k in 3 1; do
    step "spec-k$k" 200 python3 benchmarks/spec_decode.py --model builtin:tiny --traffic chat --prompts 8 \
        --max-tokens 96 -k "$k" --rollback per_token --repeat 2 --backends none,mtp,dflash,dflash2 "${extra[@]}" \
        --out "$OUT/spec-k$k.json"
done
step serve 300 python3 benchmarks/serve_spec.py --backends mtp,dflash,dflash2 --repeat 2 \
    --serve-args '--kv-profile int8-g64 --host-cache-mib 1024 --kv-capacity 2048' --out "$OUT/serve.json"
spec_table
grep -E "tok/s" "$OUT/serve.log"
summary
