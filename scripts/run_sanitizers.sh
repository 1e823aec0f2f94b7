#!/usr/bin/env bash
# The unit tests and the e2e suite under sanitizers (make test-asan / make test-tsan).
#
#   scripts/run_sanitizers.sh asan     # ASan + UBSan: every unit test, then tests/e2e against the
#                                      # sanitized server (build-asan)
#   scripts/run_sanitizers.sh tsan     # TSan: the engine's threaded unit tests, then the server's
#                                      # and router's concurrency e2e tests (build-tsan)
#   SAN_QUICK=1 scripts/run_sanitizers.sh asan|tsan
#       the bounded runs `make test` (and so CI) does: a build with KV_SANITIZE_LIGHT (the
#       compute kernels and the CLI's setup code uninstrumented; build-{asan,tsan}-quick), then
#       e2e modules against that server only. About 4 minutes of build and 1-2 of tests each on
#       2 cores.
#
# clang (Debian's clang, which setup_deps.sh installs for the fuzzers); -O1, asserts on, no
# Python module or micro-benchmarks. A sanitizer report aborts the process: a unit test fails,
# and a server that reports one (a leak included, at exit) exits non-zero, which the e2e
# fixtures check.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
kind="${1:?usage: run_sanitizers.sh asan|tsan}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
QUICK="${SAN_QUICK:-}"
CXX="${SAN_CXX:-clang++}"
# Sanitized code is several times slower: the e2e fixtures' waits and the few time bounds in the
# unit tests (a hostile template must fail within seconds, not hours) scale by this.
export KV_TEST_SLOWDOWN="${KV_TEST_SLOWDOWN:-6}"

case "$kind" in
  asan)
    dir="$ROOT/build-asan"; san="address,undefined"
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
    gtest_filter='*'
    if [[ -n "$QUICK" ]]; then
      # The API end to end (streaming, n, logprobs, stop, seeds), ~95 malformed requests,
      # shutdown, disconnects and limits (the router's drain included), /tokenize.
      e2e=(tests/e2e/test_openai_api.py tests/e2e/test_bad_requests.py tests/e2e/test_shutdown.py
           tests/e2e/test_tokenize_routes.py)
    else
      e2e=(tests/e2e --ignore=tests/e2e/test_python_api.py)  # the module would need an ASan Python
    fi
    ;;
  tsan)
    dir="$ROOT/build-tsan"; san="thread"
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/tsan.supp"
    # The thread pool's stealing split; the engine with its thread pool (every forward splits
    # matmuls and attention across it), the server's HTTP, engine and stream threads, the tiers'
    # writer threads, the cold-page loader.
    gtest_filter='ThreadPoolSteal*:ModelPaging.TheWalk*:Engine.BatchInvariance*:Engine.Preemption*:Engine.SeededSampling*:Engine.StopString*:KvTierManager*:KvTierDiskStore*:KvTierRedis*:ModelGolden.Mla*:ColdPages.StoreRoundTrip*:ColdPages.EngineSmolLM2*:KvReindex.EngineGoesPast*'
    if [[ -n "$QUICK" ]]; then
      e2e=(tests/e2e/test_openai_api.py tests/e2e/test_shutdown.py)
    else
      e2e=(tests/e2e/test_openai_api.py tests/e2e/test_shutdown.py tests/e2e/test_limits_and_auth.py
           tests/e2e/test_kv_tiers.py tests/e2e/test_disaggregation.py tests/e2e/test_web_dashboard.py)
    fi
    ;;
  *) echo "usage: run_sanitizers.sh asan|tsan" >&2; exit 2 ;;
esac

light=OFF; targets=(unit_tests kvserve); fuzz=OFF; xgrammar=()
if [[ -n "$QUICK" ]]; then dir="$dir-quick"; light=ON; targets=(kvserve); fi
# The light trees leave xgrammar uninstrumented: they link the release tree's copy when there is
# one (make test builds it first), rather than compiling it again (~1.5 min each on 2 cores).
if [[ "$light" == ON && -f "${BUILD_DIR:-build}/libkv_xgrammar.a" ]]; then
  xgrammar=(-DKV_XGRAMMAR_LIB="$(cd "${BUILD_DIR:-build}" && pwd)/libkv_xgrammar.a")
fi
# TSan: cpp-httplib compiled in from Debian's source of the installed version, instrumented like
# the rest; the uninstrumented libcpp-httplib.so's inlined atomics and guarded statics are
# invisible to TSan, which then reported races between two of its worker threads now and then.
httplib=()
if [[ "$kind" == tsan ]]; then
  if inc="$(bash scripts/fetch_httplib_source.sh)"; then
    httplib=(-DKV_HTTPLIB_INCLUDE="$inc")
  else
    echo "== tsan: WARNING: no cpp-httplib source; linking the uninstrumented library" >&2
    httplib=(-DKV_HTTPLIB_INCLUDE=)
  fi
fi
# SAN_FUZZ=1 (make test, with asan): the libFuzzer targets are built in the same tree (the library
# gets libFuzzer's coverage instrumentation too) and run_fuzz.sh runs them before the e2e tests,
# instead of compiling the same sources a second time.
if [[ -n "${SAN_FUZZ:-}" && "$kind" == asan ]]; then fuzz=ON; targets+=(fuzz_gguf fuzz_text); fi
echo "== $kind: building $dir (-fsanitize=$san, light $light, fuzz targets $fuzz)"
mkdir -p "$dir"
CXX="$CXX" cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKV_SANITIZE="$san" -DKV_SANITIZE_LIGHT="$light" \
      -DKV_FUZZ="$fuzz" -DKV_PYTHON=OFF -DKV_BUILD_BENCH=OFF "${xgrammar[@]}" "${httplib[@]}" > "$dir/configure.log" 2>&1 \
  || { cat "$dir/configure.log"; exit 1; }
cmake --build "$dir" -j"$JOBS" --target "${targets[@]}"
if [[ "$fuzz" == ON ]]; then
  # A fixed seed (run_fuzz.sh): make test is a gate, so it fuzzes the same inputs every run; a
  # random draw once failed CI on an old template-parser crash no change had touched.
  echo "== $kind: fuzzing with the targets of $dir (seed ${FUZZ_SEED:-1})"
  FUZZ_SEED="${FUZZ_SEED:-1}" FUZZ_BIN_DIR="$dir" bash scripts/run_fuzz.sh
fi

if [[ -z "$QUICK" ]]; then
  # Through ctest: one process per test (gtest_discover_tests), JOBS at a time, so a report
  # aborts only its own test and the run goes on to list every failure (one process for all of
  # them stopped at the first, after an hour and more on one core). The gtest filter becomes a
  # ctest regex over the same Suite.Test names; the non-gtest entries (no dot) are left out.
  regex="^($(sed -e 's/\./\\./g' -e 's/\*/.*/g' -e 's/:/|/g' <<< "$gtest_filter"))\$"
  echo "== $kind: unit tests (${gtest_filter}), $JOBS at a time"
  ctest --test-dir "$dir" -j"$JOBS" --output-on-failure --timeout 3600 -R "$regex" -E '^[^.]*$'
fi

echo "== $kind: e2e against $dir/kvserve (${e2e[*]})"
KVSERVE_BIN="$dir/kvserve" "$PYTHON" -m pytest -q -p no:cacheprovider "${e2e[@]}"
echo "$kind: clean"
