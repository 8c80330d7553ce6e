#!/usr/bin/env bash
# DP-SFT table at CPU scale (issue 4): all-MiniLM-L6-v2 on SST-2 (full train set, N = 67,349;
# dev 872), top-2 blocks + pooler + head trainable (LoRA: r = 16 on query/value + head).
# Every stage-2 / baseline run: 20 steps × expected batch 128 = ~2,560 examples seen; stage 1: 32 steps × 32.
# Two lanes in parallel, one thread each. Usage: bash results/dpsft_sst2_minilm.sh [OUT]
set -u
OUT=${1:-/tmp/issue4_runs}
mkdir -p "$OUT"
export PYTHONPATH=src DPFT_DATA_DIR=${DPFT_DATA_DIR:-/work/shared/data} HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-/work/main/.venv/bin/python}
R=recipes/sst2-minilm-dpsft.yaml
run() { local name=$1; shift; set -- --batch-size 128 --set subspace.expected_batch_size=32 "$@"; echo "$(date -u +%T) start $name: dpft train $R -o $OUT/$name $*" >> "$OUT/commands.log";
        $PY -m dpft.cli train $R -o "$OUT/$name" --quiet "$@" > "$OUT/$name.log" 2>&1;
        echo "$(date -u +%T) end $name rc=$?" >> "$OUT/commands.log"; }
BASE="--set subspace.source=none"
LORA="--trainable lora --set trainable.lora.r=16 --set trainable.lora.alpha=32 --lr 2e-3"
(
  run sft_public_e4 --epsilon 4
  run sft_public_e1 --epsilon 1 --set subspace.source=file --set subspace.file=$OUT/sft_public_e4/subspace/basis.safetensors
  run fulldp_e4 --epsilon 4 $BASE
  run fulldp_e1 --epsilon 1 $BASE
  run nonprivate --no-dp $BASE
  run sft_public_init_e1 --epsilon 1 --set subspace.source=file --set subspace.file=$OUT/sft_public_e4/subspace/basis.safetensors --set subspace.start=initial
) &
(
  run sft_private_e4 --epsilon 4 --set subspace.source=private --set subspace.budget_share=0.3
  run sft_private_e1 --epsilon 1 --set subspace.source=private --set subspace.budget_share=0.3
  run lora_e4 --epsilon 4 $BASE $LORA
  run lora_e1 --epsilon 1 $BASE $LORA
  run sft_public_init_e4 --epsilon 4 --set subspace.source=file --set subspace.file=$OUT/sft_public_e4/subspace/basis.safetensors --set subspace.start=initial
) &
wait
