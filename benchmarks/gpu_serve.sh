#!/usr/bin/env bash
# Serving at the 27B widths on one CUDA machine, as a user meets it: writes the 27B-width
# checkpoint (8 layers, random weights, transformers' own config) once, replays the seeded
# multi-turn trace through `hpc-cli serve` with the openai client (hybrid against off in the same
# run), and records where the hybrid server's threads spend their time with py-spy while the trace
# runs (when py-spy is on the PATH).
#
#   bash benchmarks/gpu_serve.sh OUT_DIR [serve_trace.py options...]
#   bash benchmarks/gpu_serve.sh out --edits --concurrency 1,8 \
#       --serve-args '--kv-profile int8-g64 --prefill-chunk 2048 --host-cache-mib 16384'
#
# Writes OUT_DIR/serve_trace.json (serve_trace.py's document), OUT_DIR/hybrid.pyspy.txt (py-spy's
# raw stacks, one line a stack with its count) and OUT_DIR/serve-hybrid.log (the server's log).
# CKPT (default /tmp/q27) is where the checkpoint goes; PYSPY_SECONDS (default 90) how long py-spy
# records (--nonblocking: the server is never paused, as a blocking sampler pauses every thread
# at each sample), PYSPY=0 records nothing; PORT (default 8123) the first server's port. Needs the official openai client on that
# machine (openai 3.x imports httpx2, which needs httpcore2 and truststore: carry them with it).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_serve.sh OUT_DIR [serve_trace options]}
shift
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/q27}
PORT=${PORT:-8123}
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1

if [ ! -f "$CKPT/config.json" ]; then
    python3 benchmarks/serve_trace.py --write-checkpoint "$CKPT" --shape 27b || exit 1
fi

profile_hybrid() {  # waits for the hybrid server to answer /health, then records it
    local pid=""
    for _ in $(seq 1200); do
        pid=$(pgrep -f -- "--cache-mode hybrid" | head -n 1)
        [ -n "$pid" ] && break
        sleep 0.5
    done
    [ -n "$pid" ] || return
    python3 - "$PORT" <<'EOF' || return
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(1800):
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
    py-spy record --nonblocking --pid "$pid" --threads --format raw --rate 200 -d "${PYSPY_SECONDS:-90}" \
        -o "$OUT/hybrid.pyspy.txt" > "$LOGS/py-spy.log" 2>&1
}

if [ "${PYSPY:-1}" != 0 ] && command -v py-spy >/dev/null 2>&1; then
    profile_hybrid &
fi
python3 benchmarks/serve_trace.py --model "$CKPT" --port "$PORT" --log-dir "$LOGS" --out "$OUT/serve_trace.json" "$@"
rc=$?
wait
cp "$LOGS"/serve-hybrid-*.log "$OUT/serve-hybrid.log" 2>/dev/null
tail -n 5 "$LOGS/py-spy.log" 2>/dev/null
exit $rc
