#!/usr/bin/env bash
# Follow-up to dpft_sst2_minilm.sh: DP-SFT with a private stage 1 on a larger stage-1 batch
# (B1 = 256 instead of 32, still 32 steps = 8,192 examples expected), ε ∈ {4, 1}, in parallel.
set -u
OUT=${1:-/tmp/issue4_runs}
export PYTHONPATH=src DPFT_DATA_DIR=${DPFT_DATA_DIR:-/work/shared/data} HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-/work/main/.venv/bin/python}
R=recipes/sst2-minilm-dpsft.yaml
run() { local name=$1; shift; set -- --batch-size 128 --set subspace.expected_batch_size=256 "$@";
        echo "$(date -u +%T) start $name: dpft train $R -o $OUT/$name $*" >> "$OUT/commands.log";
        $PY -m dpft.cli train $R -o "$OUT/$name" --quiet "$@" > "$OUT/$name.log" 2>&1;
        echo "$(date -u +%T) end $name rc=$?" >> "$OUT/commands.log"; }
run sft_private_b256_e4 --epsilon 4 --set subspace.source=private --set subspace.budget_share=0.3 &
run sft_private_b256_e1 --epsilon 1 --set subspace.source=private --set subspace.budget_share=0.3 &
wait
