#!/bin/bash
# User-level vs example-level DP on E2E (results/e2e_user_level.md): stories260K, full fine-tuning,
# the instruct recipe, the same ε, the same 4,095 training rows (459 MRs, one MR = one "user").
# Run from the repository root. D = shared data folder; O = run directories; PY = Python with dpft.
# Here: PYTHONPATH=src PY=/work/main/.venv/bin/python D=/work/shared/data O=/tmp/u_e2e bash results/e2e_user_level.sh
D=${D:-../shared/data}; O=${O:-runs/e2e-user-level}; EPS=${EPS:-8}
mkdir -p $O
[ -f $O/train.csv ] || ${PY:-python} results/e2e_user_level_data.py $D $O/train.csv
common="recipes/e2e-instruct-stories260k.yaml --model $D/models/stories260K --set task.train_file=$O/train.csv
  --set task.dev_file=$D/e2e/devset.csv --set task.max_train_examples=null --epsilon $EPS --steps 32
  --set eval.max_generate_prompts=100 --set eval.every_steps=32 --quiet"
run() {  # run NAME FLAGS...
  local name=$1; shift
  local t0=$(date +%s)
  DPFT_DATA_DIR=$D HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 ${PY:-python} -m dpft train $common -o $O/$name "$@" \
    > $O/$name.log 2>&1
  echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" >> $O/walltimes.txt
}
( run example-eps$EPS --batch-size 128
  run user-k4-eps$EPS --user-column user --max-rows-per-user 4 --batch-size 32 ) &
( run user-k8-eps$EPS --user-column user --max-rows-per-user 8 --batch-size 16
  run user-k4-cons-eps$EPS --user-column user --max-rows-per-user 4 --batch-size 32 --set task.user_clipping=per_example_over_k ) &
wait
