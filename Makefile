# Targets as in SB3's Makefile. `make train` sets up .venv with what training needs; `make test` (and the lint, type
# and bench targets) add the test extras on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
LINT_PATHS := sb3_speedups tests scripts

# torch first, pinned, so that pip never picks another torch build for the project's `torch>=2.3`
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e .
	touch $@

$(VENV)/.installed-tests: $(VENV)/.installed
	$(VENV)/bin/pip install -e ".[tests]"
	touch $@

# The numerically sensitive tests (ours against stock, executors, saves, collection, recurrent), run again by `make
# test-avx2` with ATen's and MKL's AVX2 code paths forced: on an AVX-512 Intel CPU that computes what AMD CPUs compute.
NUMERIC_TESTS := tests/test_equivalence.py tests/test_mlp.py tests/test_inference.py tests/test_maths.py \
	tests/test_optim.py tests/test_saves.py tests/test_off_policy_collection.py tests/test_off_policy.py \
	tests/test_dqn.py tests/test_ppo_recurrent.py tests/test_gru.py tests/test_trpo.py \
	tests/test_qrdqn.py tests/test_tqc.py tests/test_crossq.py tests/test_ars.py

.PHONY: install install-tests test test-avx2 compat train lint format type bench
install: $(VENV)/.installed

install-tests: $(VENV)/.installed-tests

test: $(VENV)/.installed-tests
	$(PY) -m pytest

test-avx2: $(VENV)/.installed-tests
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest $(NUMERIC_TESTS)

# SB3's and sb3-contrib's own test suites (from their sdists) with every fast class of ours substituted
compat: $(VENV)/.installed-tests
	$(PY) -m tests.compat.run

train: $(VENV)/.installed
	$(VENV)/bin/sb3-speedups train --algo ppo --env CartPole-v1 --seed 1

lint: $(VENV)/.installed-tests
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

format: $(VENV)/.installed-tests
	$(VENV)/bin/ruff format $(LINT_PATHS)

type: $(VENV)/.installed-tests
	$(VENV)/bin/mypy sb3_speedups

bench: $(VENV)/.installed
	$(PY) scripts/benchmark.py --algo ppo --env CartPole-v1
