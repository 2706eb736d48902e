#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, for one CUDA machine: every test marked `gpu` (file by
# file, so one hanging file does not hide the others), then each benchmark's JSON. Each step has
# its own time limit and the script carries on after a failure; a summary prints last.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]        # default ./gpu-results; about 15-20 minutes
#
# Needs torch with CUDA, Triton, transformers (model_throughput's baseline) and, for the fast
# GDN kernels, flash-linear-attention; the package itself installed (pip install -e .).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh

for f in tests/kv/test_gpu.py tests/model/test_paged_attention.py tests/model/test_fused_kernels.py \
         tests/model/test_prefill_graphs_gpu.py tests/model/test_gdn_taps_gpu.py \
         tests/memory/test_transfer_engine_gpu.py \
         tests/engine/test_engine_gpu.py tests/engine/test_cache_modes_gpu.py tests/spec/test_bf16_gpu.py tests/experts/test_gpu.py \
         tests/experts/test_placement.py tests/model/test_merged.py tests/model/test_quant_linear.py; do
    step "test-$(basename "$f" .py)" 400 python3 -m pytest -q -p no:cacheprovider -m gpu "$f"
done
step bench-kv_profiles 120 bash -c "python3 benchmarks/kv_profiles.py > '$OUT/kv_profiles.json'"
step bench-transfer 180 python3 benchmarks/transfer.py --out "$OUT/transfer.json"
step bench-model_throughput 400 python3 benchmarks/model_throughput.py --out "$OUT/model_throughput.json"
step bench-spec_decode 300 python3 benchmarks/spec_decode.py --model builtin:qwen3.5-27b-shape@8 \
    --prompt-len 256 --max-tokens 64 --prompts 2 --rollback per_token --out "$OUT/spec_decode.json"
step bench-expert_tier 300 python3 benchmarks/expert_tier.py --out "$OUT/expert_tier.json"
step bench-engine_trace 600 bash -c "python3 benchmarks/engine_trace.py > '$OUT/engine_trace.json'"
step bench-prefill 480 python3 benchmarks/prefill.py --out "$OUT/prefill.json"
step bench-serve_trace 900 bash -c "python3 benchmarks/serve_trace.py --write-checkpoint /tmp/q27 --shape 27b && \
    python3 benchmarks/serve_trace.py --model /tmp/q27 --edits --concurrency 1,8 \
    --serve-args '--kv-profile int8-g64 --prefill-chunk 2048' --out '$OUT/serve_trace.json'"

echo
summary
