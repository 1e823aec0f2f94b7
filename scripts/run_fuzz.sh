#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each for a bounded time. Fails on
# any crash, sanitizer report, leak, timeout or out-of-memory.
#
#   scripts/run_fuzz.sh                       # GGUF 30 s, tokenizer/template/request 15 s each
#   FUZZ_SECONDS=300 TEXT_FUZZ_SECONDS=600 scripts/run_fuzz.sh
#   FUZZ_TARGETS="request" scripts/run_fuzz.sh
#   FUZZ_SEED=1 scripts/run_fuzz.sh           # the same mutations every run (make test sets it)
#   FUZZ_BIN_DIR=build-asan-quick scripts/run_fuzz.sh
#                                             # runs fuzz_gguf / fuzz_text already built there (a
#                                             # CMake tree with -DKV_FUZZ=ON: `make test` builds
#                                             # them with its ASan tree instead of compiling twice)
#
# Targets:
#   gguf       tests/fuzz/fuzz_gguf.cpp: the GGUF reader (seeds: corpus_gguf/, make_seeds.py)
#   tokenizer, template, request
#              tests/fuzz/fuzz_text.cpp (one binary, KV_FUZZ_TARGET picks): both real tokenizers'
#              round trips, the chat-template engine, the OpenAI request parser. They read the
#              models in models/ (make models). Seeds: corpus_{tokenizer,template,request}/,
#              made by make_text_seeds.py.
#
# The fuzzers are built by hand from the sources they need rather than through CMake's KV_FUZZ
# build, so they do not depend on the rest of the library compiling; objects are rebuilt only
# when their source or a header under src/ is newer. What the fuzzer discovers goes to
# $OUT/corpus_* (not committed); crash inputs land in $OUT/artifacts/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${FUZZ_OUT:-$ROOT/build-fuzz}"
GGUF_SECONDS="${FUZZ_SECONDS:-30}"
TEXT_SECONDS="${TEXT_FUZZ_SECONDS:-15}"
TARGETS="${FUZZ_TARGETS:-gguf tokenizer template request}"
BIN_DIR="${FUZZ_BIN_DIR:-}"
# A fixed seed makes a run a regression check: the same inputs every time, so a gate passes or
# fails on the code, not on the draw. Unset (0): libFuzzer draws one, to explore; what a long
# exploring run finds is fixed and its input added to tests/fuzz/make_text_seeds.py or the corpus.
SEED_ARG=(-seed="${FUZZ_SEED:-0}")
CXX="${FUZZ_CXX:-clang++}"
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -Isrc)

mkdir -p "$OUT/obj" "$OUT/artifacts"
if [[ -z "$BIN_DIR" ]]; then
  # Headers CMake generates at configure time (builtin_chat_templates.h from templates/*.jinja):
  # a configure-only tree of our own provides them.
  cmake -S . -B "$OUT/cmake" -G Ninja -DKV_PYTHON=OFF -DKV_BUILD_BENCH=OFF > "$OUT/cmake.log" 2>&1 \
    || { cat "$OUT/cmake.log" >&2; exit 1; }
  FLAGS+=(-I"$OUT/cmake/generated")
fi
newest_header="$(find src -name '*.h' -newer "$OUT/.headers" 2>/dev/null | head -1 || true)"
[[ -f "$OUT/.headers" ]] || newest_header=all
touch "$OUT/.headers.new"

# Compiles sources to $OUT/obj in parallel (2 jobs), skipping up-to-date objects; prints the objects.
compile() {
  local objs=() todo=()
  for src in "$@"; do
    local obj="$OUT/obj/$(echo "$src" | tr / _).o"
    objs+=("$obj")
    if [[ ! -f "$obj" || "$src" -nt "$obj" || -n "$newest_header" ]]; then todo+=("$src"); fi
  done
  if (( ${#todo[@]} )); then
    echo "compiling ${#todo[@]} sources for the fuzzers" >&2
    local failed=0
    for src in "${todo[@]}"; do
      "$CXX" "${FLAGS[@]}" -c "$src" -o "$OUT/obj/$(echo "$src" | tr / _).o" >&2 &
      while (( $(jobs -rp | wc -l) >= 2 )); do wait -n || failed=1; done
    done
    while (( $(jobs -rp | wc -l) > 0 )); do wait -n || failed=1; done
    (( failed == 0 )) || { echo "fuzzer build failed" >&2; return 1; }
  fi
  printf '%s\n' "${objs[@]}"
}

link() {  # link OUT_BIN OBJ...
  local bin="$1"; shift
  local stale=0
  [[ -x "$bin" ]] || stale=1
  for o in "$@"; do [[ "$o" -nt "$bin" ]] && stale=1; done
  if (( stale )); then
    "$CXX" -fsanitize=fuzzer,address,undefined "$@" -lpcre2-8 -o "$bin.tmp"
    mv "$bin.tmp" "$bin"
  fi
}

export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"

for t in $TARGETS; do
  case "$t" in
    gguf)
      bin="$BIN_DIR/fuzz_gguf"
      if [[ -z "$BIN_DIR" ]]; then
        compile tests/fuzz/fuzz_gguf.cpp src/gguf/gguf.cpp src/kernels/ggml_types.cpp > "$OUT/objs"
        mapfile -t objs < "$OUT/objs"
        bin="$OUT/fuzz_gguf"
        link "$bin" "${objs[@]}"
      fi
      mkdir -p "$OUT/corpus_gguf"
      echo "fuzzing the GGUF reader for ${GGUF_SECONDS}s"
      # A hostile input of at most 64 KiB may cost a few MB of metadata, never hundreds.
      "$bin" "$OUT/corpus_gguf" tests/fuzz/corpus_gguf \
        -max_len=65536 -max_total_time="$GGUF_SECONDS" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
        -artifact_prefix="$OUT/artifacts/" -print_final_stats=1 "${SEED_ARG[@]}"
      ;;
    tokenizer|template|request)
      bin="$BIN_DIR/fuzz_text"
      if [[ -z "$BIN_DIR" ]]; then
        compile tests/fuzz/fuzz_text.cpp src/tokenizer/*.cpp src/gguf/gguf.cpp src/kernels/ggml_types.cpp \
                src/server/openai_request.cpp src/kv/eviction_policy.cpp src/engine/spec_config.cpp src/common/*.cpp > "$OUT/objs"
        mapfile -t objs < "$OUT/objs"
        bin="$OUT/fuzz_text"
        link "$bin" "${objs[@]}"
      fi
      mkdir -p "$OUT/corpus_$t"
      echo "fuzzing the $t target for ${TEXT_SECONDS}s"
      # Each input is at most 8 KiB; a template that loops or recurses without bound hits the
      # 10 s timeout or the 2 GiB RSS limit, and fails the run.
      KV_FUZZ_TARGET="$t" "$bin" "$OUT/corpus_$t" "tests/fuzz/corpus_$t" \
        -max_len=8192 -max_total_time="$TEXT_SECONDS" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$OUT/artifacts/" -print_final_stats=1 "${SEED_ARG[@]}"
      ;;
    *) echo "unknown fuzz target $t" >&2; exit 2 ;;
  esac
done
if [[ -z "$BIN_DIR" ]]; then mv "$OUT/.headers.new" "$OUT/.headers"; else rm -f "$OUT/.headers.new"; fi
echo "fuzz runs clean"
