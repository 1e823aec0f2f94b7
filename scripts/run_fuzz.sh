#!/usr/bin/env bash
# Builds the GGUF fuzzer (libFuzzer + ASan + UBSan, clang) and runs it for a bounded time.
# Fails on any crash, sanitizer report, leak, timeout or out-of-memory.
#
#   scripts/run_fuzz.sh                 # 60 s
#   FUZZ_SECONDS=300 scripts/run_fuzz.sh
#
# The fuzzer is built by hand from the two sources it needs (gguf.cpp, ggml_types.cpp) rather
# than through CMake's KV_FUZZ build, so it does not depend on the rest of the library
# compiling. Seeds come from tests/fuzz/corpus_gguf/ (committed, made by make_seeds.py);
# what the fuzzer discovers goes to $OUT/corpus (not committed). Crash inputs land in
# $OUT/artifacts/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${FUZZ_OUT:-$ROOT/build-fuzz-gguf}"
SECONDS_TO_RUN="${FUZZ_SECONDS:-60}"
CXX="${FUZZ_CXX:-clang++}"
BIN="$OUT/fuzz_gguf"
SOURCES=("$ROOT/tests/fuzz/fuzz_gguf.cpp" "$ROOT/src/gguf/gguf.cpp" "$ROOT/src/kernels/ggml_types.cpp")
HEADERS=("$ROOT/src/gguf/gguf.h" "$ROOT/src/kernels/ggml_types.h" "$ROOT/src/common/status.h")

mkdir -p "$OUT/corpus" "$OUT/artifacts"

# Rebuild only when a source or header is newer than the binary.
needs_build=0
if [[ ! -x "$BIN" ]]; then
  needs_build=1
else
  for f in "${SOURCES[@]}" "${HEADERS[@]}" "${BASH_SOURCE[0]}"; do
    if [[ "$f" -nt "$BIN" ]]; then needs_build=1; break; fi
  done
fi
if (( needs_build )); then
  echo "building $BIN"
  "$CXX" -std=c++20 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$ROOT/src" "${SOURCES[@]}" -o "$BIN.tmp"
  mv "$BIN.tmp" "$BIN"
fi

echo "fuzzing GGUF parser for ${SECONDS_TO_RUN}s"
# A hostile input of at most 64 KiB may cost a few MB of metadata, never hundreds.
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
"$BIN" "$OUT/corpus" "$ROOT/tests/fuzz/corpus_gguf" \
  -max_len=65536 -max_total_time="$SECONDS_TO_RUN" -timeout=10 \
  -rss_limit_mb=2048 -malloc_limit_mb=256 \
  -artifact_prefix="$OUT/artifacts/" -print_final_stats=1
echo "fuzz run clean"
