#!/usr/bin/env bash
# Install build and test dependencies: Debian packages (apt) and Python packages (pip).
# Idempotent and fast on re-runs:
#   - apt runs only when `dpkg-query` says a package is missing;
#   - pip runs only when requirements-dev.txt or requirements-nodeps.txt changed since the last
#     success (stamp in .stamps/), and then installs only the requirements not already satisfied
#     (those of requirements-nodeps.txt without their declared dependencies).
# Env: FORCE=1 ignores the pip stamp; PYTHON overrides the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
REQ="$ROOT/requirements-dev.txt"
REQ_NODEPS="$ROOT/requirements-nodeps.txt"
STAMPS="$ROOT/.stamps"

log() { echo "[setup_deps] $*"; }

APT_PACKAGES=(
  build-essential cmake ninja-build clang libclang-rt-14-dev
  libcli11-dev libcpp-httplib-dev nlohmann-json3-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libspdlog-dev libpcre2-dev
  libhiredis-dev redis-server
  libjs-marked
  iproute2
  chromium
  qemu-user
)

# ---------------------------------------------------------------- apt
missing=()
for p in "${APT_PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if (( ${#missing[@]} )); then
  SUDO=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    SUDO=(sudo)
  fi
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -q
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  log "apt: all ${#APT_PACKAGES[@]} packages present"
fi

# ---------------------------------------------------------------- xgrammar (source, compiled by CMake)
PYTHON="$PY" "$ROOT/scripts/fetch_xgrammar.sh"

# ---------------------------------------------------------------- pip
pyver="$("$PY" -c 'import sys; print(sys.executable, sys.version)')"
key="$( { sha256sum "$REQ" "$REQ_NODEPS" | cut -d' ' -f1; echo "$pyver"; } | sha256sum | cut -c1-16)"
stamp="$STAMPS/pip-$key"

if [[ -f "$stamp" && "${FORCE:-0}" != 1 ]]; then
  log "pip: requirements unchanged (stamp ${stamp#"$ROOT"/}), skipping"
  exit 0
fi

# Print the requirement lines of a file that the current environment does not satisfy.
unsatisfied_in() {
  "$PY" - "$1" <<'PYEOF'
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import Requirement

for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        continue
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        print(line)
        continue
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        print(line)
PYEOF
}

# pip_install FILE [pip options...]
pip_install() {
  local file="$1"
  shift
  local unsatisfied
  unsatisfied="$(unsatisfied_in "$file")"
  if [[ -n "$unsatisfied" ]]; then
    mapfile -t want <<<"$unsatisfied"
    log "pip: installing ${want[*]} $*"
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --disable-pip-version-check \
      --progress-bar off "$@" "${want[@]}"
  else
    log "pip: all requirements of ${file#"$ROOT"/} already satisfied"
  fi
}
pip_install "$REQ"
pip_install "$REQ_NODEPS" --no-deps

mkdir -p "$STAMPS"
rm -f "$STAMPS"/pip-*
touch "$stamp"
log "done"
