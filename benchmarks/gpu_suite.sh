#!/usr/bin/env bash
# dpft's GPU checks in one command (issue 26, item 6); under 10 minutes on one H100.
#
#   bash benchmarks/gpu_suite.sh            # on a machine with CUDA: runs everything below
#   bash benchmarks/gpu_suite.sh --dry-run  # prints the plan (every command), runs nothing
#   bash benchmarks/gpu_suite.sh --smoke    # the same script paths on the CPU at toy sizes
#
# Stages (each under its own time limit; a stage that fails or times out is reported, the suite
# goes on):
#   1. step speed: benchmarks/step_speed.py --preset gpu (bf16, the causal-LM cases at full shape)
#      for the non-private step, dpft's book-keeping engine and Opacus 1.6 ghost clipping on the
#      same cases -> benchmarks/results/step_speed_cuda.md
#   2. end-to-end instruct runs (E2E NLG, prompt = MR, completion = reference) through the CLI:
#      the real stories260K, then a random-initialised Qwen2-0.5B-shaped model (494M parameters,
#      benchmarks/gpu_make_model.py); BLEU / ROUGE-L of greedy dev generations, ε from the ledger,
#      s/step, peak GPU memory -> benchmarks/results/gpu_suite_cuda.md
#   3. with more than one visible GPU: the same runs under torchrun, DDP (one process per GPU,
#      NCCL) and FSDP2 (perf.sharding: fsdp, when this dpft has it), ledgers compared with the
#      1-process run -> benchmarks/results/gpu_suite_cuda.md
#
# The GPU machine has Python 3.12, torch+CUDA, transformers, peft, accelerate and sacrebleu but no
# internet: the other wheels (dp-accounting, pydantic, datasets, Opacus, ...) and the data come
# from benchmarks/gpu_carry/ (made here by benchmarks/gpu_wheels.sh; carry that folder along).
# dpft itself runs from this checkout (PYTHONPATH=src), nothing is installed into the image.
# Environment: PYTHON (default python3), DPFT_DATA_DIR (default: benchmarks/gpu_carry/data, else
# ../shared/data), RUNS (run directories, default runs/gpu_suite), OUT (if set, results and logs are
# copied there too).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=gpu
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --smoke) MODE=smoke ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "unknown option $a (--dry-run, --smoke)" >&2; exit 2 ;;
  esac
done
DRY=${DRY:-0}
PY=${PYTHON:-python3}
RUNS=${RUNS:-runs/gpu_suite}
CARRY=benchmarks/gpu_carry
if [ -z "${DPFT_DATA_DIR:-}" ]; then
  for d in "$CARRY/data" ../shared/data shared/data; do
    if [ -d "$d/models/stories260K" ]; then DPFT_DATA_DIR=$(cd "$d" && pwd); break; fi
  done
fi
DATA=${DPFT_DATA_DIR:-../shared/data}
export DPFT_DATA_DIR=$DATA HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "$MODE" = smoke ]; then
  TAG=smoke; DEVICE=cpu; DTYPE=fp32; RES=$RUNS/results
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  SPEED=(--preset tiny --device cpu --cases gpt2-full-8x512 qwen2-0.5b-lora-8x512 --repeats 1 --warmup 0 --no-memory)
  # toy sizes: a few steps, a few dev rows and prompts
  SMALL=(--set task.max_train_examples=64 --set task.max_dev_examples=16 --set batch.expected_batch_size=16
         --set batch.max_physical_batch_size=8 --set schedule.steps=2 --set eval.every_steps=2
         --set eval.max_generate_prompts=4 --set eval.max_new_tokens=8 --set eval.batch_size=8)
  QWEN=(--set model.max_length=64)
  MAKE=(--tiny); NPROC=2; T_SPEED=300; T_RUN=600; T_DIST=600
else
  TAG=cuda; DEVICE=cuda; DTYPE=bf16; RES=benchmarks/results
  # Qwen2 and Llama first (what people fine-tune), then the GPT-2 cases; a case starts only
  # within the stage's budget (--time-budget), so the stage ends in time whatever the machine.
  SPEED=(--preset gpu --repeats 5 --warmup 2 --time-budget 150
         --cases qwen2-0.5b-full-8x512 qwen2-0.5b-lora-8x512 llama-3.2-1b-lora-8x512 llama-3.2-1b-full-8x512
                 qwen2-0.5b-full-32x128 qwen2-0.5b-lora-32x128 llama-3.2-1b-lora-32x128 llama-3.2-1b-full-32x128
                 gpt2-full-8x512 gpt2-medium-full-8x512 gpt2-full-32x128 gpt2-medium-full-32x128)
  SMALL=()
  # 494M parameters: 20 logical steps of B = 64 (physical 32) at T = 128, generation on 64 dev MRs
  QWEN=(--set model.max_length=128 --set batch.expected_batch_size=64 --set batch.max_physical_batch_size=32
        --set schedule.steps=20 --set eval.every_steps=20 --set eval.max_generate_prompts=64
        --set eval.max_new_tokens=32 --set eval.batch_size=32 --set optimizer.lr=3e-4)
  MAKE=(); NPROC=0; T_SPEED=230; T_RUN=150; T_DIST=150
fi
SUMMARY=$RES/gpu_suite_${TAG}.md
LOGS=$RUNS/logs
STORIES=(train recipes/e2e-instruct-stories260k.yaml --device "$DEVICE" --dtype "$DTYPE" --quiet
         --set "model.name=$DATA/models/stories260K" --set "task.train_file=$DATA/e2e/trainset.csv"
         --set "task.dev_file=$DATA/e2e/devset.csv" "${SMALL[@]}")
QMODEL=$RUNS/qwen2-0.5b-random
QWENRUN=(train recipes/e2e-instruct-stories260k.yaml --device "$DEVICE" --dtype "$DTYPE" --quiet
         --set "model.name=$QMODEL" --set "task.train_file=$DATA/e2e/trainset.csv"
         --set "task.dev_file=$DATA/e2e/devset.csv" "${SMALL[@]}" "${QWEN[@]}")

declare -a STAGES=()
run() {  # run NAME LIMIT_S CMD...: print it; unless --dry-run, run it under a time limit, log it
  local name=$1 limit=$2; shift 2
  echo "+ [$name, ≤ ${limit}s] $*"
  [ "$DRY" = 1 ] && return 0
  mkdir -p "$LOGS"
  local t0=$SECONDS
  timeout --kill-after=20 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local st=ok; [ $rc = 124 ] || [ $rc = 137 ] && st="timed out"; [ $rc != 0 ] && [ "$st" = ok ] && st="failed (exit $rc)"
  STAGES+=("| $name | $st | $((SECONDS - t0)) |")
  echo "  -> $st in $((SECONDS - t0)) s (log: $LOGS/$name.log)"
  [ $rc = 0 ] || tail -5 "$LOGS/$name.log" | sed 's/^/     /'
  return 0
}

echo "dpft GPU suite: mode $MODE, data $DATA, runs $RUNS, results $RES"
# 0. Python packages the image lacks, from the carried wheels (never from an index).
if [ -d "$CARRY/wheels" ] && [ "$MODE" = gpu ]; then
  run install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dpft-site "$CARRY"/wheels/*.whl
  export PYTHONPATH=$ROOT/src:/tmp/dpft-site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$DRY" != 1 ]; then
  mkdir -p "$RES" "$LOGS"
  if [ "$MODE" = gpu ]; then
    NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [ "${NGPU:-0}" -lt 1 ]; then
      echo "no CUDA device visible: run on a GPU machine, or use --smoke (CPU, toy sizes)" >&2; exit 1
    fi
    NPROC=$NGPU
  fi
  "$PY" - <<'EOF' > "$LOGS/versions.txt" 2>&1
import importlib.metadata as md, platform, torch
def v(p):
    try: return md.version(p)
    except md.PackageNotFoundError: return "missing"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), GPUs: "
      f"{torch.cuda.device_count()} x {gpu}; " + ", ".join(f"{p} {v(p)}" for p in
      ("transformers", "peft", "accelerate", "opacus", "dp-accounting", "pydantic", "datasets", "sacrebleu")))
import dpft.cli  # noqa: F401  (fails here, not in every stage, when a package is missing)
EOF
  cat "$LOGS/versions.txt"
fi
HAS_FSDP=0
if [ "$DRY" != 1 ] && "$PY" -c 'import sys, typing; from dpft.config import PerfCfg; f = PerfCfg.model_fields.get("sharding"); sys.exit(0 if f is not None and "fsdp" in str(f.annotation) else 1)' 2>/dev/null; then
  HAS_FSDP=1
fi

# 1. step speed: dpft against Opacus ghost clipping, same cases, same precision
run step_speed "$T_SPEED" "$PY" benchmarks/step_speed.py "${SPEED[@]}" --methods nonprivate dpft-bk opacus-ghost \
  --out "$RES/step_speed_${TAG}.md"

# 2. end-to-end instruct runs, one process
run e2e_stories260k "$T_RUN" "$PY" benchmarks/gpu_suite.py run "$RUNS/stories" -- "${STORIES[@]}" --output-dir "$RUNS/stories"
run make_qwen2_0.5b 120 "$PY" benchmarks/gpu_make_model.py --tokenizer "$DATA/models/stories260K" --out "$QMODEL" "${MAKE[@]}"
run e2e_qwen2_0.5b "$T_RUN" "$PY" benchmarks/gpu_suite.py run "$RUNS/qwen" -- "${QWENRUN[@]}" --output-dir "$RUNS/qwen"

# 3. across processes (NCCL on GPUs, gloo in the smoke run): DDP, then FSDP2 where dpft has it
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC")
DIST=()
if [ "$DRY" = 1 ] || [ "$NPROC" -gt 1 ]; then
  [ "$DRY" = 1 ] && TORCHRUN[4]=--nproc_per_node='$NGPU'
  run ddp_stories260k "$T_DIST" "${TORCHRUN[@]}" benchmarks/gpu_suite.py run "$RUNS/stories_ddp" -- "${STORIES[@]}" \
    --output-dir "$RUNS/stories_ddp"
  run ddp_qwen2_0.5b "$T_DIST" "${TORCHRUN[@]}" benchmarks/gpu_suite.py run "$RUNS/qwen_ddp" -- "${QWENRUN[@]}" \
    --output-dir "$RUNS/qwen_ddp"
  DIST+=("stories260K DDP=$RUNS/stories_ddp" "Qwen2-0.5B DDP=$RUNS/qwen_ddp")
  if [ "$DRY" = 1 ] || [ "$HAS_FSDP" = 1 ]; then
    [ "$DRY" = 1 ] && echo "  (only when dpft's PerfCfg has perf.sharding: fsdp)"
    run fsdp_qwen2_0.5b "$T_DIST" "${TORCHRUN[@]}" benchmarks/gpu_suite.py run "$RUNS/qwen_fsdp" -- "${QWENRUN[@]}" \
      --set perf.sharding=fsdp --output-dir "$RUNS/qwen_fsdp"
    DIST+=("Qwen2-0.5B FSDP2=$RUNS/qwen_fsdp")
  else
    STAGES+=("| fsdp_qwen2_0.5b | skipped: this dpft has no perf.sharding: fsdp | 0 |")
  fi
else
  STAGES+=("| ddp / fsdp | skipped: one GPU visible (needs ≥ 2) | 0 |")
fi

[ "$DRY" = 1 ] && { echo "dry run: nothing was run"; exit 0; }
{
  echo "# dpft GPU suite ($TAG)"
  echo
  echo "- command: \`bash benchmarks/gpu_suite.sh $*\`; date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
  echo "- $(head -1 "$LOGS/versions.txt")"
  echo "- step speed: \`$RES/step_speed_${TAG}.md\`; run directories: \`$RUNS\`; logs: \`$LOGS\`"
  echo
  echo "| stage | status | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${STAGES[@]}"
} > "$SUMMARY"
"$PY" benchmarks/gpu_suite.py report "End-to-end instruct runs (E2E NLG; BLEU/ROUGE-L on greedy dev generations)" \
  "$SUMMARY" "stories260K=$RUNS/stories" "Qwen2-0.5B (random init)=$RUNS/qwen" >/dev/null
if [ ${#DIST[@]} -gt 0 ]; then
  "$PY" benchmarks/gpu_suite.py report --ledgers "stories260K: 1 process against DDP (ledgers must be identical)" \
    "$SUMMARY" "stories260K 1 process=$RUNS/stories" "${DIST[0]}" >/dev/null
  "$PY" benchmarks/gpu_suite.py report --ledgers "Qwen2-0.5B: 1 process against DDP / FSDP2 (ledgers must be identical)" \
    "$SUMMARY" "Qwen2-0.5B 1 process=$RUNS/qwen" "${DIST[@]:1}" >/dev/null
fi
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then
  cp "$SUMMARY" "$RES/step_speed_${TAG}.md" "$OUT"/ 2>/dev/null
  tar czf "$OUT/gpu_suite_logs.tgz" "$LOGS" 2>/dev/null
fi
