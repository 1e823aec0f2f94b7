# kvserve developer entry points. Every target that needs the toolchain or the models
# depends on `deps` / `models`, which are idempotent and fast when nothing is missing.

SHELL       := /bin/bash
PYTHON      ?= python3
BUILD_DIR   ?= build
BUILD_TYPE  ?= Release
JOBS        ?= 2
CTEST_TIMEOUT ?= 900
MODEL       ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT      ?= The three most important ideas in computer science are
N_TOKENS    ?= 64

.PHONY: all deps models text build test serve bench peer clean distclean python-install

all: build

deps:
	scripts/setup_deps.sh

models:
	scripts/fetch_models.sh

# The public-domain text `kvserve perplexity` and its tests run on (data/text/, git-ignored).
text:
	scripts/fetch_text.sh

build: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DPython_EXECUTABLE="$$(command -v $(PYTHON))"
	cmake --build $(BUILD_DIR) -j$(JOBS)

# A hung test fails after CTEST_TIMEOUT seconds instead of eating the CI budget.
# pytest exits 5 when it collects no test: not a failure while tests/py is still empty.
# tests/e2e starts the real server (build/kvserve serve) on the default model.
# SAN_FUZZ=1: the bounded ASan tree also builds the libFuzzer targets, and scripts/run_fuzz.sh runs them.
test: deps models text build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j$(JOBS) --timeout $(CTEST_TIMEOUT)
	$(PYTHON) -m pytest -q --durations=12 tests/py tests/e2e; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest: no tests collected in tests/py tests/e2e"; rc=0; fi; \
	  exit $$rc
	SAN_QUICK=1 SAN_FUZZ=1 PYTHON=$(PYTHON) JOBS=$(JOBS) bash scripts/run_sanitizers.sh asan
	SAN_QUICK=1 PYTHON=$(PYTHON) JOBS=$(JOBS) bash scripts/run_sanitizers.sh tsan

# Sanitizers (docs/reliability.md): ASan + UBSan over every unit test and the e2e suite; TSan over
# the engine's and the server's concurrency. Each has its own build tree (build-asan, build-tsan).
# `make test` runs the bounded subsets (SAN_QUICK=1).
.PHONY: test-asan test-tsan
test-asan: deps models text
	PYTHON=$(PYTHON) JOBS=$(JOBS) bash scripts/run_sanitizers.sh asan
test-tsan: deps models
	PYTHON=$(PYTHON) JOBS=$(JOBS) bash scripts/run_sanitizers.sh tsan

# The Python package (docs/python.md) into the current interpreter, built by scikit-build-core from
# pyproject.toml (`make build` also puts an importable copy in build/python).
python-install: deps
	$(PYTHON) -m pip install .

# The OpenAI-compatible server on the default model; PORT= picks the port, SERVE_ARGS adds flags (--api-key, ...).
HOST        ?= 127.0.0.1
PORT        ?= 8080
SERVE_ARGS  ?=
serve: deps models build
	./$(BUILD_DIR)/kvserve serve -m $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench: deps models build
	if [ -f bench/run_bench.py ]; then $(PYTHON) bench/run_bench.py; \
	  else echo "bench/run_bench.py not present yet"; fi

peer:
	bench/peer/build_llama.sh

# Decode speed at long context (0-8k), kvserve f16/int8/int4 KV vs llama.cpp f16/q8_0 KV:
# bench/out/context_bench.{json,png}. CONTEXT_BENCH_ARGS adds flags (--rounds 5, --wait-load 1.5).
CONTEXT_BENCH_ARGS ?=
.PHONY: bench-context
bench-context: deps models build peer
	$(PYTHON) bench/context_bench.py --kvserve $(BUILD_DIR)/kvserve $(CONTEXT_BENCH_ARGS)

# Serving throughput sweep, 1/4/16/64 users at temperature 0.7 and 0, kvserve vs llama-server in
# one run: bench/out/sweep_bench.{json,png}. SWEEP_ARGS adds flags (--repeats 3, --kvserve-arg=...).
SWEEP_ARGS ?=
.PHONY: bench-sweep
bench-sweep: deps models build peer
	$(PYTHON) bench/sweep_bench.py --kvserve $(BUILD_DIR)/kvserve $(SWEEP_ARGS)

# Speculative decoding (docs/speculative.md): batch-1 decode on code / document / chat workloads with
# and without drafts, llama.cpp's lookup decoding in the same run, and 16 users:
# bench/out/spec_bench.{json,png}. SPEC_BENCH_ARGS adds flags (--repeats 5, --no-peer).
SPEC_BENCH_ARGS ?=
.PHONY: bench-spec
bench-spec: deps models text build
	LLAMA_WITH_LOOKUP=1 bench/peer/build_llama.sh
	$(PYTHON) bench/spec_bench.py --kvserve $(BUILD_DIR)/kvserve $(SPEC_BENCH_ARGS)

# Long-context KV policies (docs/eviction.md): perplexity per policy and budget (both texts, 4k
# and 8k), decode speed per policy and context, passkey retrieval through the server. ~1.5 h
# on 2 cores; outputs in bench/out/ and docs/*.png.
.PHONY: bench-eviction
bench-eviction: deps models text build
	$(PYTHON) bench/eviction_quality.py --kvserve $(BUILD_DIR)/kvserve
	$(PYTHON) bench/eviction_speed.py --kvserve $(BUILD_DIR)/kvserve
	$(PYTHON) bench/eviction_users.py --kvserve $(BUILD_DIR)/kvserve
	$(PYTHON) bench/passkey_bench.py --kvserve $(BUILD_DIR)/kvserve
	$(PYTHON) bench/reindex_quality.py --kvserve $(BUILD_DIR)/kvserve

# Scale-out (docs/disaggregation.md): colocated vs prefill + decode behind the router, and prefix
# affinity vs round-robin over 2 replicas. DISAGG_ARGS adds flags (--parts pd, --repeats 3, ...).
DISAGG_ARGS ?=
# Reliability soak (docs/reliability.md): 64 clients for 10 minutes, random parameters, 20%
# disconnecting; zero failures, flat RSS, every page back. SOAK_ARGS adds flags (--duration 60).
SOAK_ARGS ?=
.PHONY: soak
soak: deps models build
	$(PYTHON) bench/soak.py --kvserve $(BUILD_DIR)/kvserve $(SOAK_ARGS)

.PHONY: bench-disagg
bench-disagg: deps models text build
	$(PYTHON) bench/disagg_bench.py --kvserve $(BUILD_DIR)/kvserve $(DISAGG_ARGS)

# KV tiers: TTFT of 2k/4k/8k-token documents recomputed vs loaded from the L2 disk tier (after a
# restart) vs the L3 Redis tier (another instance; needs /usr/bin/redis-server), and swap vs
# recompute preemption at 4k context: bench/out/tier_bench.{json,png}, about 5-8 min on 2 cores (estimate).
# TIER_BENCH_ARGS adds flags (--repeats 5, --phases disk swap, --replot).
TIER_BENCH_ARGS ?=
.PHONY: bench-tiers
bench-tiers: deps models text build
	$(PYTHON) bench/tier_bench.py --kvserve $(BUILD_DIR)/kvserve $(TIER_BENCH_ARGS)

clean:
	rm -rf $(BUILD_DIR)

# Also drops the pip stamp, bench output and the llama.cpp peer build (slow to redo).
# Models are kept: scripts/fetch_models.sh re-verifies them.
distclean: clean
	rm -rf .stamps bench/out bench/peer/work
