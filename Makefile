# Two commands set everything up on a fresh machine: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for the demo and the tests; the package itself accepts any torch>=2.4 the user has.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo lint test unit bench clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# ~35 ms steps: on a 2-core machine the OS's scheduling of two ranks makes one of them late by ~2 ms a step, which
# is a fifth of the example's default 10 ms step (enough to be named a straggler) but a small share of this one
demo: venv
	$(VENV)/bin/dtprof run -- $(VENV)/bin/torchrun --nproc_per_node=2 examples/train_ddp.py --steps 30 --dim 128 --seq 64

# ruff (lint + import order) and mypy, configured in pyproject.toml; `make test` runs them first and fails on them
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# two workers, each test file on one of them (its module fixtures are shared by its tests): the real jobs wait on
# each other (rendezvous, timeouts, Ray) as much as they compute, so two at once fit the 2-core CI machine
# --no-loadscope-reorder: files in the order tests/conftest.py gives them (the jobs first, the unit files after)
# compileall first: where PYTHONDONTWRITEBYTECODE is set, Python never caches the repository's own modules, and
# every process the suite starts (launchers, ranks, CLI calls: thousands) would compile them again
test: lint
	$(PY) -m compileall -q dtprof collectors analyzers reports examples tests >/dev/null
	$(PY) -m pytest -q -raR -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# tests/unit only: synthetic and stored runs, no real jobs (a few minutes); `make test` runs tests/jobs too
unit: venv
	$(PY) -m pytest -q tests/unit

# hta_figures.py runs under a Python with HolisticTraceAnalysis (never a dtprof dependency): see its docstring
bench: venv
	for b in $(filter-out benchmarks/hta_figures.py,$(wildcard benchmarks/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
