#!/usr/bin/env bash
# Follow-ups to dpft_sst2_minilm.sh (run after it; same OUT folder), one thread each:
#   private  : DP-SFT with a private stage 1 on a larger stage-1 batch (B1 = 256 instead of 32,
#              still 32 steps = 8,192 examples expected), ε = 4;
#   long     : Full-DP and DP-SFT (public basis, start Θ0) with 60 steps × 128 = 7,680 examples, ε = 4.
# Usage: bash results/dpsft_sst2_minilm_extra.sh private|long [OUT]
set -u
WHAT=$1
OUT=${2:-/tmp/issue4_runs}
export PYTHONPATH=src DPFT_DATA_DIR=${DPFT_DATA_DIR:-/work/shared/data} HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-/work/main/.venv/bin/python}
R=recipes/sst2-minilm-dpsft.yaml
run() { local name=$1; shift; set -- --batch-size 128 "$@";
        echo "$(date -u +%T) start $name: dpft train $R -o $OUT/$name $*" >> "$OUT/commands.log";
        $PY -m dpft.cli train $R -o "$OUT/$name" --quiet "$@" > "$OUT/$name.log" 2>&1;
        echo "$(date -u +%T) end $name rc=$?" >> "$OUT/commands.log"; }
if [ "$WHAT" = private ]; then
  run sft_private_b256_e4 --epsilon 4 --set subspace.source=private --set subspace.budget_share=0.3 \
      --set subspace.expected_batch_size=256
else
  LONG="--steps 60 --set eval.every_steps=60 --set checkpoint_every=60"
  run fulldp_long_e4 --epsilon 4 --set subspace.source=none $LONG &
  run sft_public_init_long_e4 --epsilon 4 --set subspace.source=file \
      --set subspace.file=$OUT/sft_public_e4/subspace/basis.safetensors --set subspace.start=initial $LONG &
  wait
fi
