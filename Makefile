# The two set-up commands of the README: `make demo` and `make test` create the venv themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint format demo bench bench-peers bench-router-bound clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(STAMP)
	$(BIN)/trio-pd demo

# Benchmarks (bench/README.md). BENCH_ARGS passes extra flags, e.g. BENCH_ARGS=--quick.
WRK_INSTALL = command -v wrk >/dev/null 2>&1 || apt-get install -y -qq wrk >/dev/null 2>&1 \
	|| (apt-get update -qq && apt-get install -y -qq wrk) >/dev/null 2>&1 \
	|| echo "wrk unavailable: the Python load generator runs alone (router-bound needs wrk)"
PEERS_INSTALL = (test -x bench/.peers/bin/python || $(PYTHON) -m venv bench/.peers) \
	&& bench/.peers/bin/python -m pip install -q 'sglang-router==0.3.2'

bench: $(STAMP)
	@$(WRK_INSTALL)
	$(BIN)/python -m bench run --quick $(BENCH_ARGS)

bench-peers: $(STAMP)
	@$(WRK_INSTALL)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench run --peers $(BENCH_ARGS)

# The router-bound scenario alone, all four routers, 3 repetitions (about 12 minutes on 2 cores;
# BENCH_ARGS=--quick about 6).
bench-router-bound: $(STAMP)
	@$(WRK_INSTALL)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench run --peers --scenarios router-bound $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
