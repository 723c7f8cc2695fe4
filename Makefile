# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The newest JAX release needs Python 3.12 (with pyenv: PYENV_VERSION=3.12.1).
NEWEST_PYTHON ?= python3.12

.PHONY: setup demo test test-newest wheel-check hip report mi50 clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Results go to experiments/results/local/ (git-ignored): the committed ones change only
# with --out-dir experiments/results.
demo: setup
	$(PY) -m experiments.seq_scaling $(DEMO_ARGS)

# Two test processes (pytest-xdist), each taking whole test files (a module's fixtures,
# such as the hipcc build or the 8-device ring subprocess, run once): CI's machine has
# two cores. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The suite on the newest JAX in pyproject's range, in its own venv (.venv312).
test-newest:
	$(MAKE) test PYTHON=$(NEWEST_PYTHON) VENV=.venv312

# The wheel in a fresh venv with the newest JAX, run from outside the checkout.
wheel-check:
	.ci/wheel_check $(NEWEST_PYTHON)

hip: setup
	$(PY) -m hip_ffi.build

report: setup
	$(PY) -m hip_ffi.build --report

# On an MI50 with ROCm and a ROCm JAX (hip_ffi/README.md): build against this machine's
# ROCm, audit, check against float64, time (10 warm-up, 50 measured, median and p95).
mi50: setup
	$(PY) -m hip_ffi.build --target rocm --report
	$(PY) -m experiments.hip_check --target rocm

clean:
	rm -rf $(VENV) .venv312 hip_ffi/_build .pytest_cache build *.egg-info
