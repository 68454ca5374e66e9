# Every target that runs code depends on the venv stamp: the venv is created when missing and
# reused (only re-synced when pyproject.toml changes).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers: two use both cores of the 2-core CI host (many tests are one Python thread);
# tests/conftest.py keeps each file, and all Ray tests, on one worker. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

.PHONY: install test test-fast demo bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=30 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/python -m mm_pipeline.demo

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/kv_capacity.py --quick
	$(VENV)/bin/python benchmarks/text_throughput.py --quick

clean-venv:
	rm -rf $(VENV)
