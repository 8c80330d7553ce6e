#!/bin/bash
# E2E instruct runs on stories260K (results/e2e_stories260k.md): two queues of three runs, at most two at once.
# Run from the repository root; D = the shared data folder; O = where the run directories go;
# PY = the Python with dpft installed. Here: PYTHONPATH=src PY=/work/main/.venv/bin/python D=/work/shared/data O=/tmp/instr/e2e bash results/e2e_stories260k.sh
D=${D:-../shared/data}; O=${O:-runs/e2e-instruct}
common="--model $D/models/stories260K --set task.train_file=$D/e2e/trainset.csv --set task.dev_file=$D/e2e/devset.csv --quiet"
run() {  # run NAME RECIPE FLAGS...
  local name=$1 recipe=$2; shift 2
  local t0=$(date +%s)
  DPFT_DATA_DIR=$D HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 ${PY:-python} -m dpft train $recipe $common -o $O/$name "$@" > $O/$name.log 2>&1
  echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" >> $O/walltimes.txt
}
mkdir -p $O
( run full-eps3 recipes/e2e-instruct-stories260k.yaml --epsilon 3
  run full-eps8 recipes/e2e-instruct-stories260k.yaml --epsilon 8
  run full-nodp recipes/e2e-instruct-stories260k.yaml --no-dp ) &
( run lora-eps8 recipes/e2e-instruct-stories260k-lora.yaml --epsilon 8
  run lora-eps3 recipes/e2e-instruct-stories260k-lora.yaml --epsilon 3
  run lora-nodp recipes/e2e-instruct-stories260k-lora.yaml --no-dp ) &
wait
