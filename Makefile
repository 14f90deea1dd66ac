# One venv, built here, used by every target. torch goes in first, pinned: other versions download gigabytes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test test-unit test-integration test-under-load lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev,digits,parquet]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/p2ptrain demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# No network, no p2pd (tests/conftest.py refuses sockets in unit tests): seconds, anywhere.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -m integration

# The suite 5 times in a row beside 2 CPU-bound processes: it must not depend on timing.
test-under-load: $(STAMP)
	$(BIN)/python -m tests.under_load --runs 5 --hogs 2 --json bench/results/test-suite.json

lint: $(STAMP)
	$(BIN)/ruff check p2ptrain tests bench
	$(BIN)/ruff format --check p2ptrain tests bench
	$(BIN)/mypy p2ptrain

bench: $(STAMP)
	$(BIN)/python -m bench.quality
	$(BIN)/python -m bench.quality --set outer.num_rounds=48 --out bench/results/quality-long.json --block quality-long
	$(BIN)/python -m bench.compression
	$(BIN)/python -m bench.churn
	$(BIN)/python -m bench.attacks --repeat 3
	$(BIN)/python -m bench.robustness
	$(BIN)/python -m bench.round_warmup
	$(BIN)/python -m bench.replicas
	$(BIN)/python -m bench.verification
	$(BIN)/python -m bench.heterogeneous
	$(BIN)/python -m bench.utilization --seeds 0 1 2
	$(BIN)/python -m bench.link
	$(BIN)/python -m bench.split
	$(BIN)/python -m bench.overlap
	$(BIN)/python -m bench.overlap --set outer.lr=0.5 --taus 3 --carries 0.5 --out bench/results/overlap-lr0.5.json --block overlap-lr0.5
	$(BIN)/python -m bench.overlap --set outer.lr=0.9 --taus 3 --carries 0.5 --out bench/results/overlap-lr0.9.json --block overlap-lr0.9
	$(BIN)/python -m bench.overlap --peers 2 --seeds 0 1 2 3 4 --tau-ranges 1-3 1-15 --draws 2 --out bench/results/overlap-pairs.json --block overlap-pairs
	$(BIN)/python -m bench.overlap --config configs/tiny.yaml --set outer.num_rounds=5 --peers 2 --seeds 0 1 2 3 4 --tau-ranges 1-2 1-5 --draws 10 --out bench/results/overlap-pairs-tiny.json --block overlap-pairs-tiny
	$(BIN)/python -m bench.overlap --config configs/tiny.yaml --set outer.num_rounds=5 --peers 2 --seeds 0 1 2 3 4 --tau-ranges 1-2 1-5 --draws 10 --set outer.lr=0.7 --out bench/results/overlap-pairs-tiny-lr0.7.json --block overlap-pairs-tiny-lr0.7
	$(BIN)/python -m bench.overlap --config configs/tiny.yaml --set outer.num_rounds=5 --peers 2 --seeds 0 1 2 3 4 --tau-ranges 1-2 1-5 --draws 10 --set outer.lr=0.7 --set outer.momentum=0 --out bench/results/overlap-pairs-tiny-lr0.7-m0.json --block overlap-pairs-tiny-lr0.7-m0
	$(BIN)/python -m bench.data
	$(BIN)/python -m bench.llama
	$(BIN)/python -m bench.kinds

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
