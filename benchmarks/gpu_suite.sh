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
#   4. the LLM recipes (issue 38): random-initialised Llama-3.2-1B and Llama-3.1-8B shapes
#      (benchmarks/llm_jobs.py make: weights from the configs, no hub), then chat SFT at user level
#      with LoRA and QLoRA (recipes/chat-sft-llama-{1b,8b}-{lora,qlora}-user.yaml, the example chat
#      data's 117 users, 16 expected users per step) and DPO on preference pairs
#      (recipes/trl/dpo-pairs-llama-8b-lora.yaml, pairs made from the same chats), each private run
#      beside the non-private run of the same recipe (--no-dp): s/step and peak GPU memory, and
#      their ratios; and Opacus 1.6's FSDP2 ghost clipping (grad_sample_mode ghost_fsdp, one process)
#      on the 1B model with LoRA at 8 x 512 tokens (stage 1 times dpft at that shape), skipped with a
#      message when the installed Opacus has no FSDP2 -> benchmarks/results/gpu_suite_cuda.md
#   --no-llm skips stage 4; --llm-only runs stage 4 alone (it takes longer than 10 minutes with 8B).
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
    --no-llm) LLM=0 ;;
    --llm-only) LLMONLY=1 ;;
    -h|--help) sed -n '2,42p' "$0"; exit 0 ;;
    *) echo "unknown option $a (--dry-run, --smoke, --no-llm, --llm-only)" >&2; exit 2 ;;
  esac
done
DRY=${DRY:-0}
LLM=${LLM:-1}
LLMONLY=${LLMONLY:-0}
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
  # stage 4 at toy sizes: tiny random Llamas, one step, CPU, fp32
  LLMMAKE=(--tiny); LLMSET=(--device cpu --dtype fp32 --steps 2 --set model.max_length=64
                            --set batch.max_physical_batch_size=4); DPOSET=(--steps 1 --set dpo.max_length=512)
  OPACUS=(--batch 2 --seq 32 --steps 1); T_MAKE=120; T_LLM=600
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
  # stage 4: the recipes' own shapes and physical batches, 5 logical steps of 16 expected users
  LLMMAKE=(); LLMSET=(--device cuda --steps 5); DPOSET=(--steps 5); OPACUS=(--batch 8 --seq 512 --steps 5)
  T_MAKE=420; T_LLM=600
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

if [ "$LLMONLY" = 1 ]; then
  echo "(--llm-only: stages 1-3 skipped)"
else
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
fi  # --llm-only

# 4. the LLM recipes (issue 38): SFT at user level with LoRA / QLoRA, DPO, each against its non-private
#    run; Opacus 1.6 FSDP2 ghost clipping on the same 1B model
LLMJOBS=()
if [ "$LLM" = 1 ]; then
  M1B=$RUNS/llama-3.2-1b-random; M8B=$RUNS/llama-3.1-8b-random
  CHATS=(--set task.train_file=examples/chat-support/train.jsonl --set task.dev_file=examples/chat-support/dev.jsonl
         --set batch.expected_batch_size=16 --set eval.generate=false --set eval.every_steps=100000
         --set checkpoint_every=100000 --set task.max_dev_examples=16)
  run make_llama_1b "$T_MAKE" "$PY" benchmarks/llm_jobs.py make --shape llama-3.2-1b --tokenizer "$DATA/models/stories260K" \
    --out "$M1B" "${LLMMAKE[@]}"
  run make_llama_8b "$T_MAKE" "$PY" benchmarks/llm_jobs.py make --shape llama-3.1-8b --tokenizer "$DATA/models/stories260K" \
    --out "$M8B" "${LLMMAKE[@]}"
  for size in 1b 8b; do
    model=$M1B; [ $size = 8b ] && model=$M8B
    for q in lora qlora; do
      rec=recipes/chat-sft-llama-$size-$q-user.yaml; tag=sft_${size}_${q}; label="SFT ${size^^} ${q/qlora/QLoRA} user"
      label=${label/ lora / LoRA }
      run "${tag}_dp" "$T_LLM" "$PY" benchmarks/llm_jobs.py sft "$RUNS/$tag" -- train "$rec" --quiet \
        --set "model.name=$model" "${CHATS[@]}" "${LLMSET[@]}" --output-dir "$RUNS/$tag"
      run "${tag}_nodp" "$T_LLM" "$PY" benchmarks/llm_jobs.py sft "$RUNS/${tag}_nodp" -- train "$rec" --quiet --no-dp \
        --set "model.name=$model" "${CHATS[@]}" "${LLMSET[@]}" --output-dir "$RUNS/${tag}_nodp"
      LLMJOBS+=("$label DP=$RUNS/$tag" "$label non-private=$RUNS/${tag}_nodp")
    done
  done
  DPO=recipes/trl/dpo-pairs-llama-8b-lora.yaml
  run dpo_8b_lora_dp "$T_LLM" "$PY" benchmarks/llm_jobs.py dpo "$DPO" --model "$M8B" --run-dir "$RUNS/dpo_8b" \
    --pairs-from examples/chat-support/train.jsonl --set dp.expected_batch_size=16 "${DPOSET[@]}"
  run dpo_8b_lora_nodp "$T_LLM" "$PY" benchmarks/llm_jobs.py dpo "$DPO" --model "$M8B" --run-dir "$RUNS/dpo_8b_nodp" \
    --pairs-from examples/chat-support/train.jsonl --no-dp "${DPOSET[@]}"
  run opacus_fsdp_ghost_1b_lora "$T_LLM" "$PY" benchmarks/llm_jobs.py opacus --model "$M1B" --lora \
    --run-dir "$RUNS/opacus_1b" "${OPACUS[@]}"
  LLMJOBS+=("DPO 8B LoRA pairs DP=$RUNS/dpo_8b" "DPO 8B LoRA pairs non-private=$RUNS/dpo_8b_nodp"
            "Opacus 1.6 FSDP2 ghost clipping, 1B LoRA (compare stage 1's dpft-bk at 8x512)=$RUNS/opacus_1b")
else
  STAGES+=("| LLM recipes (stage 4) | skipped: --no-llm | 0 |")
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
[ "$LLMONLY" = 1 ] || "$PY" benchmarks/gpu_suite.py report "End-to-end instruct runs (E2E NLG; BLEU/ROUGE-L on greedy dev generations)" \
  "$SUMMARY" "stories260K=$RUNS/stories" "Qwen2-0.5B (random init)=$RUNS/qwen" >/dev/null
if [ ${#DIST[@]} -gt 0 ]; then
  "$PY" benchmarks/gpu_suite.py report --ledgers "stories260K: 1 process against DDP (ledgers must be identical)" \
    "$SUMMARY" "stories260K 1 process=$RUNS/stories" "${DIST[0]}" >/dev/null
  "$PY" benchmarks/gpu_suite.py report --ledgers "Qwen2-0.5B: 1 process against DDP / FSDP2 (ledgers must be identical)" \
    "$SUMMARY" "Qwen2-0.5B 1 process=$RUNS/qwen" "${DIST[@]:1}" >/dev/null
fi
if [ ${#LLMJOBS[@]} -gt 0 ]; then
  "$PY" benchmarks/llm_jobs.py table "$SUMMARY" "LLM recipes: private step against the non-private step (issue 38)" \
    "${LLMJOBS[@]}" >/dev/null
fi
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then
  cp "$SUMMARY" "$RES/step_speed_${TAG}.md" "$OUT"/ 2>/dev/null
  tar czf "$OUT/gpu_suite_logs.tgz" "$LOGS" 2>/dev/null
fi
