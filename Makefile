# One venv, built here, used by every target. torch goes in first, pinned: other versions download gigabytes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test test-unit test-integration lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/p2ptrain demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/integration

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

lint: $(STAMP)
	$(BIN)/ruff check p2ptrain tests bench
	$(BIN)/ruff format --check p2ptrain tests bench
	$(BIN)/mypy p2ptrain

bench: $(STAMP)
	$(BIN)/python -m bench.quality
	$(BIN)/python -m bench.compression
	$(BIN)/python -m bench.churn

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
