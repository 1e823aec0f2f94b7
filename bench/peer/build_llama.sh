#!/usr/bin/env bash
# Build the peer: llama.cpp's llama-bench, llama-completion (the plain one-shot generator),
# llama-perplexity (the oracle of `kvserve perplexity`, used by bench/ppl_compare.py)
# and llama-server (the OpenAI-compatible HTTP server, the peer of `kvserve serve`, used by
# bench/serve_bench.py). LLAMA_WITH_SERVER=0 skips llama-server; LLAMA_WITH_CLI=1 also builds
# the newer chat llama-cli (which shares the server library).
#
# Sources: the llama.cpp tree vendored inside the PyPI sdist of llama-cpp-python
# (vendor/llama.cpp). Everything lands in bench/peer/work/ (git-ignored); llama.cpp
# sources are never committed.
#
# Idempotent: does nothing when the binaries already exist (FORCE=1 rebuilds).
#
# Env:
#   LLAMA_CPP_PYTHON_VERSION  sdist version to use (default pinned below)
#   LLAMA_WITH_SERVER=0       do not build llama-server (default 1)
#   LLAMA_WITH_CLI=1          also build llama-cli
#   LLAMA_WITH_LOOKUP=1       also build llama-lookup (prompt-lookup speculative decoding, the
#                             peer of --speculative-config ngram; bench/spec_bench.py)
#   JOBS                      parallel build jobs (default: nproc)
#   FORCE=1                   rebuild even if the binaries exist
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${PEER_WORK_DIR:-$ROOT/bench/peer/work}"
VER="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"

SRC_PARENT="$WORK/src"
SRC="$SRC_PARENT/llama_cpp_python-$VER/vendor/llama.cpp"
BUILD="$WORK/build-$VER"
BIN="$BUILD/bin"

targets=(llama-bench llama-completion llama-perplexity)
[[ "${LLAMA_WITH_SERVER:-1}" == 1 ]] && targets+=(llama-server)
[[ "${LLAMA_WITH_CLI:-0}" == 1 ]] && targets+=(llama-cli)
[[ "${LLAMA_WITH_LOOKUP:-0}" == 1 ]] && targets+=(llama-lookup)
need_server=0
[[ "${LLAMA_WITH_SERVER:-1}" == 1 || "${LLAMA_WITH_CLI:-0}" == 1 ]] && need_server=1

log() { echo "[build_llama] $*"; }

all_built=1
for t in "${targets[@]}"; do [[ -x "$BIN/$t" ]] || all_built=0; done
if [[ "$all_built" == 1 && "${FORCE:-0}" != 1 ]]; then
  log "already built: ${targets[*]} in $BIN (FORCE=1 to rebuild)"
  ln -sfn "build-$VER" "$WORK/build"
  exit 0
fi

mkdir -p "$WORK/dl" "$SRC_PARENT"

# 1. fetch the sdist (cached in work/dl)
SDIST="$WORK/dl/llama_cpp_python-$VER.tar.gz"
if [[ ! -s "$SDIST" ]]; then
  log "downloading llama-cpp-python==$VER sdist from PyPI"
  tmp="$(mktemp -d "$WORK/dl/tmp.XXXXXX")"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$tmp"
  mv "$tmp"/llama_cpp_python-*.tar.gz "$SDIST"
  rm -rf "$tmp"
else
  log "using cached $SDIST"
fi

# 2. unpack only vendor/llama.cpp
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  log "unpacking vendor/llama.cpp"
  rm -rf "$SRC_PARENT/llama_cpp_python-$VER"
  tar -xzf "$SDIST" -C "$SRC_PARENT" "llama_cpp_python-$VER/vendor/llama.cpp"
fi

# 3. configure + build (CPU only, native ISA, static, no network features). The server's web
#    UI is not embedded (LLAMA_BUILD_UI=OFF) and not downloaded (LLAMA_USE_PREBUILT_UI=OFF):
#    llama-server then serves the API only, which is all the benchmark needs.
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
start=$(date +%s)
log "configuring in $BUILD"
cmake -S "$SRC" -B "$BUILD" "${gen[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_OPENCL=OFF \
  -DGGML_BACKEND_DL=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES="$([[ "${LLAMA_WITH_LOOKUP:-0}" == 1 ]] && echo ON || echo OFF)" \
  -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_SERVER="$([[ "$need_server" == 1 ]] && echo ON || echo OFF)" \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_COMMIT="llama-cpp-python-$VER" \
  > "$WORK/configure-$VER.log" 2>&1 || { tail -40 "$WORK/configure-$VER.log"; exit 1; }

log "building ${targets[*]} with -j$JOBS (log: $WORK/build-$VER.log)"
cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" > "$WORK/build-$VER.log" 2>&1 \
  || { tail -60 "$WORK/build-$VER.log"; exit 1; }

ln -sfn "build-$VER" "$WORK/build"
log "done in $(( $(date +%s) - start ))s: $(for t in "${targets[@]}"; do printf '%s ' "$BIN/$t"; done)"
log "run: $WORK/build/bin/llama-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 512 -n 128 -o json"
[[ "$need_server" == 1 ]] && log "     $WORK/build/bin/llama-server -m models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8081 -t 2"
exit 0
