# Sourced by the GPU scripts: `step NAME SECONDS COMMAND...` runs one step with its own time
# limit into "$OUT/NAME.log" (the script carries on after a failure) and records a summary line
# (its exit code, seconds, and the log's last line naming passes, failures, warm-ups or errors);
# `summary` prints them; `spec_table` prints a line per backend of each OUT/*-k*.json (spec-k1, before-k1, ...) that
# benchmarks/spec_decode.py wrote; `checkpoints DIR` writes the 27B-width checkpoint to DIR/bf16
# and its FP8 copy to DIR/fp8 unless they are there; `out_dirs SCRIPT DEFAULT_LOGS OUT_DIR` sets
# and makes OUTDIR (the script's argument, required), OUT (the logs: $LOGS, else DEFAULT_LOGS) and
# CK (the checkpoints: $CK, else /tmp/ck). Needs OUT set.
declare -a SUMMARY
out_dirs() {
    OUTDIR=${3:?usage: $1 OUT_DIR}
    export OUT=${LOGS:-$2}
    CK=${CK:-/tmp/ck}
    export PYTHONUNBUFFERED=1
    mkdir -p "$OUTDIR" "$OUT"
}
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) \
        "$(grep -E 'passed|failed|warm-up|configurations|rror' "$OUT/$name.log" | tail -n 1)")")
    tail -n 3 "$OUT/$name.log"
}
checkpoints() {
    [ -f "$1/bf16/config.json" ] || step checkpoint 300 python3 benchmarks/serve_trace.py --write-checkpoint "$1/bf16" --shape 27b
    [ -f "$1/fp8/config.json" ] || step quantize-fp8 300 hpc-cli quantize "$1/bf16" "$1/fp8" --format fp8
}
summary() {
    printf '%s\n' "${SUMMARY[@]}"
}
spec_table() {
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*-k*.json")):
    doc = json.loads(f.read_text())
    if "runs" not in doc:
        continue
    for key, r in doc["runs"].items():
        split = ""
        if r.get("rounds"):  # chained rounds and the round split (an earlier tree's JSON may lack them)
            split = (f"  chained {r.get('verify_chained', 0)}/{r['rounds']}"
                     f"  round ahead {r.get('round_ms_verified_ahead')} ms, other {r.get('round_ms_other')} ms,"
                     f" outside rounds {r.get('outside_rounds_ms_per_request')} ms a request")
        print(f"{f.stem:10} k={doc['k']}  {key:18} {r['decode_tok_s']:8.1f} tok/s  {r['speedup']:5.2f}x none"
              f"  {r['mean_acceptance_length']:5.3f} tokens a round  same as none: {r.get('matches_none', True)}{split}")
PY
}
