# dpft: the two commands of the README.
#   make demo  - create .venv, install dpft, DP fine-tune MiniLM on SST-2 (ε = 8), print accuracy and ε
#   make test  - create .venv, install dpft with test extras, run pytest (CI's share: not the slow checks)
#   make test-all - the same with the checks marked slow (about 20 more minutes on 2 cores)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SHARED_DATA := $(abspath ../shared/data)
# Offline task files (../shared/data beside the project) when present; else the HF hub.
ifneq ($(wildcard $(SHARED_DATA)/MANIFEST.md),)
export DPFT_DATA_DIR ?= $(SHARED_DATA)
endif
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-all install clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: the pinned CPU wheel, so nothing pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/dpft train recipes/sst2-minilm.yaml --output-dir runs/demo-$(shell date +%Y%m%d-%H%M%S)

# CI's share: every check but those marked slow (> 20 s each on 2 cores: end-to-end runs on real
# models, multi-process equality, measured benchmarks), which `make test-all` adds.
test: install
	$(BIN)/python -m pytest tests -m "not slow"

test-all: install
	$(BIN)/python -m pytest tests

bench: install
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python benchmarks/step_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache
