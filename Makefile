# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test hip report mi50 clean

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
	rm -rf $(VENV) hip_ffi/_build .pytest_cache
