# Targets as in SB3's Makefile. `make test` and `make train` set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
LINT_PATHS := sb3_speedups tests scripts

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e ".[tests]"
	touch $@

.PHONY: install test train lint format type bench
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest

train: $(VENV)/.installed
	$(VENV)/bin/sb3-speedups train --algo ppo --env CartPole-v1 --seed 1

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

format: $(VENV)/.installed
	$(VENV)/bin/ruff format $(LINT_PATHS)

type: $(VENV)/.installed
	$(VENV)/bin/mypy sb3_speedups

bench: $(VENV)/.installed
	$(PY) scripts/benchmark.py --algo ppo --env CartPole-v1
