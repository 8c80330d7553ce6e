#!/usr/bin/env bash
# EW-FT vs DP-Forward on an SST-2 subset (MiniLM, T = 64, B = 32, C = 1, δ = 1e-5, E = 3,
# lr 5e-4: 2e-5 learned nothing in 96 steps, see results). Usage: benchmarks/ewft_sst2.sh STREAM [N]   (STREAM = a | b in parallel; c = non-private full FT;
# d = fixed-σ sweep; e = positions embeddings / output at ε = 8;
# f = σ = 0 references there; g = output position with N examples)
# Then: python benchmarks/ewft_table.py runs/ewft > results/ewft_sst2.md
set -euo pipefail
STREAM=$1; N=${2:-1000}
PY=${PY:-/work/main/.venv/bin/python}
export PYTHONPATH=src OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 DPFT_DATA_DIR=${DPFT_DATA_DIR:-/work/shared/data}
OUT=${OUT:-runs/ewft}
run() {  # name recipe extra-args...
  local name=$1 recipe=$2; shift 2
  [ -f "$OUT/$name/report.json" ] && return 0
  rm -rf "$OUT/$name"
  echo "== $name $(date -u +%T)"
  $PY -m dpft.cli train "$recipe" -o "$OUT/$name" --max-train-examples "$N" --quiet \
      --lr 5e-4 --set ldp.autoencoder.public_examples=500 \
      --set ldp.autoencoder.pretrain_epochs=30 --set ldp.autoencoder.pretrain_lr=3e-3 "$@"
}
EW=recipes/sst2-minilm-ewft.yaml; DF=recipes/sst2-minilm-dpforward.yaml
if [ "$STREAM" = a ]; then
  run nonprivate-ae  $EW --set ldp.noise_multiplier=0 --set ldp.target_epsilon=null
  for e in 2 4 8; do run dpforward-eps$e $DF --set ldp.target_epsilon=$e; done
  run ewpba-only-eps8 $DF --set ldp.schedule=ewpba --set ldp.target_epsilon=8
elif [ "$STREAM" = b ]; then
  for e in 2 4 8; do run ewft-eps$e $EW --set ldp.target_epsilon=$e; done
  run ae-only-eps8 $EW --set ldp.schedule=uniform --set ldp.target_epsilon=8
fi
if [ "$STREAM" = e ]; then  # Table 6's other perturbation positions at ε = 8
  for pos in embeddings output; do
    run ewft-eps8-$pos $EW --set ldp.target_epsilon=8 --set ldp.position=$pos
    run dpforward-eps8-$pos $DF --set ldp.target_epsilon=8 --set ldp.position=$pos
  done
fi
if [ "$STREAM" = f ]; then  # σ = 0 references (split + AE, clipping only) at the other positions
  for pos in embeddings output; do
    run nonprivate-ae-$pos $EW --set ldp.noise_multiplier=0 --set ldp.target_epsilon=null --set ldp.position=$pos
  done
fi
if [ "$STREAM" = g ]; then  # more data at the cheapest position (output): does anything come through?
  run ewft-eps8-output-n$N $EW --set ldp.target_epsilon=8 --set ldp.position=output
  run dpforward-eps8-output-n$N $DF --set ldp.target_epsilon=8 --set ldp.position=output
  run nonprivate-ae-output-n$N $EW --set ldp.noise_multiplier=0 --set ldp.target_epsilon=null --set ldp.position=output
fi
if [ "$STREAM" = d ]; then  # σ sweep with the autoencoder: where does the signal come through?
  for s in 0.2 0.05; do run ewft-ae-fixed-sigma$s $EW --set ldp.noise_multiplier=$s --set ldp.target_epsilon=null; done
fi
echo "== done $STREAM $(date -u +%T)"
# stream c: a plain non-private full fine-tune of the unsplit model (no clipping, no noise)
if [ "$STREAM" = c ]; then
  [ -f "$OUT/nonprivate-fullft/report.json" ] || $PY -m dpft.cli train recipes/sst2-minilm.yaml --no-dp \
    -o "$OUT/nonprivate-fullft" --max-train-examples "$N" --trainable full --epochs 3 --batch-size 32 \
    --max-physical-batch-size 32 --lr 2e-5 --eval-every 1000 --quiet --set schedule.steps=null \
    --set schedule.warmup_steps=0 --set checkpoint_every=1000
fi
