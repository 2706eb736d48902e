#!/usr/bin/env bash
# The block drafters of `builtin:tiny` trained again on one CUDA machine and measured against the
# shipped ones in the same run: for each recipe, `scripts/train_tiny.py` with the model frozen
# (blocks of k = 3 only, ANCHORS draft blocks a row), then `benchmarks/spec_decode.py` on the
# model's own chat traffic at k = 1, 2, 3 with both drafter sets (`--drafters`). A table of tokens
# a round and decode speed against `none` prints last.
#
#   bash benchmarks/gpu_drafters.sh OUT_DIR
#
# DATA (default .tiny-data, from `python3 scripts/tiny_corpus.py --out .tiny-data`) is the corpus;
# SECONDS_EACH (default 140) the training time of each recipe; ANCHORS (default 128) the draft
# blocks a row; RECIPES (default "continue scratch"): `continue` starts from the shipped drafters,
# `scratch` from seeded weights with LAYERS (default 2) drafter layers, `anchor` anchor-drafting
# ones with LAYERS layers started from the MTP head (`--anchor-drafts`), `LABEL=DIR` from the
# drafters in DIR/dflash, DIR/dflash2 (for example a CPU run's). KS (default "1 2 3") are the k
# measured, none skips the measurement. Each recipe's drafters and report are packed into
# OUT/drafters-RECIPE.tar (the recipes train under WORK, default OUT/train). About 10 minutes on
# an H200 with two recipes.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_drafters.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_steps.sh
DATA=${DATA:-.tiny-data}
SECS=${SECONDS_EACH:-140}
ANCH=${ANCHORS:-128}
WORK=${WORK:-$OUT/train}
drafters=()
for recipe in ${RECIPES:-continue scratch}; do
    label=${recipe%%=*}
    extra=(--draft-lr 2e-3 --draft-layers "${LAYERS:-2}")
    [ "$recipe" = continue ] && extra=(--init-drafters hpc_cli/model/tiny --draft-lr 1e-3)
    [ "$recipe" = anchor ] && extra=(--draft-lr 2e-3 --draft-layers "${LAYERS:-2}" --anchor-drafts)
    [ "$label" != "$recipe" ] && extra=(--init-drafters "${recipe#*=}" --draft-lr 1e-3)
    step "train-$label" $((SECS + 240)) python3 scripts/train_tiny.py --data "$DATA" --out "$WORK/$label" \
        --init-from hpc_cli/model/tiny --no-mtp --block-sizes 3 --anchors "$ANCH" --draft-seconds "$SECS" \
        --batch 64 --seq 512 --val-rows 64 --final-val-rows 64 "${extra[@]}"
    if [ -f "$WORK/$label/tiny/dflash/model.safetensors" ]; then
        drafters+=(--drafters "$label=$WORK/$label/tiny")
        tar -cf "$OUT/drafters-$label.tar" -C "$WORK/$label" tiny/dflash tiny/dflash2 report.json
    fi
done
for k in ${KS-1 2 3}; do
    step "spec-k$k" 300 python3 benchmarks/spec_decode.py --model builtin:tiny --traffic chat --prompts 8 \
        --max-tokens 96 -k "$k" --rollback per_token --repeat 3 --backends none,mtp,dflash,dflash2 \
        "${drafters[@]}" --out "$OUT/spec-k$k.json"
done
spec_table
summary
