#!/usr/bin/env bash
# Prepare what benchmarks/gpu_suite.sh needs beyond the repository on a GPU machine that has
# Python 3.12, torch+CUDA, transformers, accelerate and sacrebleu but NO internet:
#   benchmarks/gpu_carry/wheels/  wheels (py3.12, manylinux x86_64, --no-deps) of dpft's other
#                                 dependencies and of Opacus 1.6 (the step-speed comparison)
#   benchmarks/gpu_carry/data/    stories260K and the E2E train/dev CSVs (from ../shared/data)
# and print the total size, which must stay under 64 MiB (what one device call may carry).
# benchmarks/gpu_carry/ is git-ignored. Run it here (with internet), from the repository root:
#   bash benchmarks/gpu_wheels.sh            # then carry benchmarks/gpu_carry to the GPU machine
# Versions: the ones the test suite runs with here (dp-accounting 0.6.0, pydantic 2.14, datasets
# 5.2, peft 0.21.2 = pyproject's pinned range), Opacus 1.6.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=benchmarks/gpu_carry
DATA=${DPFT_DATA_DIR:-../shared/data}
mkdir -p "$OUT/wheels" "$OUT/data/models" "$OUT/data/e2e"

# Binary wheels (one version of each: two would stop the install on the GPU machine).
BIN=(
  dp-accounting==0.6.0 dm-tree==0.1.10
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  peft==0.21.2 opacus==1.6.0 nltk==3.10.4
)
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform any)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d "$OUT/wheels" "${BIN[@]}"
# rouge-score (ROUGE-L of the instruct runs) is published as an sdist only: build its pure-Python wheel.
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" rouge-score==0.1.2

cp -r "$DATA/models/stories260K" "$OUT/data/models/"
cp "$DATA/e2e/trainset.csv" "$DATA/e2e/devset.csv" "$OUT/data/e2e/"

total=$(du -sb "$OUT" | cut -f1)
echo "wheels:"; ls -1 "$OUT/wheels"
printf 'total %s bytes (%.1f MiB) in %s: wheels %s, data %s\n' "$total" "$(echo "$total/1048576" | bc -l)" "$OUT" \
  "$(du -sh "$OUT/wheels" | cut -f1)" "$(du -sh "$OUT/data" | cut -f1)"
if [ "$total" -ge $((64 * 1024 * 1024)) ]; then
  echo "ERROR: $OUT is over 64 MiB: it cannot travel in one device call" >&2
  exit 1
fi
