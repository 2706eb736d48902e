#!/usr/bin/env bash
# Speculative decoding on one CUDA machine after a change to the rounds' CUDA paths: the GPU tests
# of the draft graphs and round tails, then `benchmarks/spec_decode.py` on builtin:tiny's own chat
# traffic at each k of KS (none, MTP, DFlash, DFlash2 and any DRAFTERS sets in the same run), the
# kernels a step and a round launch (`benchmarks/round_kernels.py`), the block drafters' fused
# kernels alone against torch's ops (`benchmarks/drafter_kernels.py`), then
# `benchmarks/serve_spec.py` through HTTP with the official client. A table prints last.
#
#   bash benchmarks/gpu_spec.sh OUT_DIR
#
# DATA (default .tiny-data, from `python3 scripts/tiny_corpus.py --out .tiny-data`): where it
# exists, 64 held-out prompts of its validation split (`--chat-data`), else the 8 fixed questions.
# KS (default "1 3"); DRAFTERS: extra drafter sets for spec_decode, "label=DIR ..." (DIR holding
# dflash/ and dflash2/); BEFORE: a directory holding an earlier tree's hpc_cli/ and hpc_kernels/,
# whose spec_decode runs at the first k too (on PYTHONPATH: before and after on one machine);
# AHEAD: spec_decode's --ahead (default all: each backend with the round ahead, the proposal
# ahead, neither);
# SERVE=0 skips the HTTP step; TESTS: 1 (default) the draft-graph, verify-column, rotary-table,
# made-ahead and compiled fused-kernel tests, all the whole GPU file of speculative tests, 0 none. About 6 minutes on an H200 with the
# defaults.
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
        tests/model/test_rotary_table.py tests/model/test_fused_kernels.py \
        -k "graph_drafts or warmup_covers_serving or verify_columns or rotary or ahead or compiled" ;;
esac
extra=()
for d in ${DRAFTERS:-}; do extra+=(--drafters "$d"); done
DATA=${DATA:-.tiny-data}
traffic=(--traffic chat --prompts 8)
[ -d "$DATA" ] && traffic=(--traffic chat --chat-data "$DATA" --prompts 64)
KS=${KS:-1 3}
for k in $KS; do
    step "spec-k$k" 300 python3 benchmarks/spec_decode.py --model builtin:tiny "${traffic[@]}" \
        --max-tokens 96 -k "$k" --rollback per_token --repeat 2 --backends none,mtp,dflash,dflash2 "${extra[@]}" \
        --ahead "${AHEAD:-all}" \
        --out "$OUT/spec-k$k.json"
done
if [ -n "${BEFORE:-}" ]; then
    k=${KS%% *}
    step "before-k$k" 200 env PYTHONPATH="$BEFORE:${PYTHONPATH:-}" python3 benchmarks/spec_decode.py \
        --model builtin:tiny "${traffic[@]}" --max-tokens 96 -k "$k" --rollback per_token --repeat 2 \
        --backends none,mtp,dflash,dflash2 --ahead off --out "$OUT/before-k$k.json"
fi
chat=()
[ -d "$DATA" ] && chat=(--chat-data "$DATA")
step kernels 120 python3 benchmarks/round_kernels.py "${chat[@]}" -k "${KS%% *}" --top 40 --out "$OUT/kernels.json"
step drafter-kernels 120 python3 benchmarks/drafter_kernels.py --out "$OUT/drafter_kernels.json"
if [ "${SERVE:-1}" != 0 ]; then
    step serve 300 python3 benchmarks/serve_spec.py --backends mtp,dflash,dflash2 --repeat 2 \
        --serve-args '--kv-profile int8-g64 --host-cache-mib 1024 --kv-capacity 2048' --out "$OUT/serve.json"
    grep -E "tok/s" "$OUT/serve.log"
fi
spec_table
summary
