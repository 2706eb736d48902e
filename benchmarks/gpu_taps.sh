#!/usr/bin/env bash
# The zero-split tap and the warm-up on one CUDA machine, in one go: the GPU qualification tests
# of the tap rule and the prefill graphs, the tap cost (benchmarks/gdn_taps.py), then two cold
# warm-ups of the 27B-width engine (fresh Triton caches): one tuning fla's kernels as fla does,
# whose chosen configurations are written to OUT/fla-configs.tar, and one with those
# configurations pinned (hpc_cli/model/fla_configs.py, scripts/fla_configs.py). A summary prints last.
#
#   bash benchmarks/gpu_taps.sh OUT_DIR
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_taps.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh
step tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x -s tests/model/test_gdn_taps_gpu.py \
    tests/model/test_prefill_graphs_gpu.py
step gdn_taps 120 bash -c "python3 benchmarks/gdn_taps.py > '$OUT/gdn_taps.json'"
FLA=$(mktemp -d)
step warmup-tuned 150 env TRITON_CACHE_DIR="$(mktemp -d)" python3 scripts/fla_configs.py "$FLA"
tar -C "$FLA" -cf "$OUT/fla-configs.tar" .
step warmup-pinned 120 env TRITON_CACHE_DIR="$(mktemp -d)" FLA_CACHE_MODE=strict FLA_CONFIG_DIR="$FLA" \
    python3 scripts/fla_configs.py "$(mktemp -d)"
cat "$OUT/gdn_taps.json" 2>/dev/null | grep -E '"(plain_s|in_pass_s|split_s|copy_s|tap_s|pass_tap_s|tap_cost_over_copy|pass_tap_cost_over_copy|in_pass_throughput|split_throughput|graph_replays)"'
summary
