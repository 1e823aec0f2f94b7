#!/usr/bin/env bash
# Fetch the source of xgrammar (structured outputs: JSON schema, regex and grammar constraints as
# token masks; Apache-2.0, the library vLLM and SGLang use) into .deps/ (git-ignored), pinned by
# version and sha256. CMakeLists.txt compiles its C++ core into the library (no Python bindings).
# PyPI is the one place its source is published that this machine reaches; the sdist is read
# through PyPI's JSON API, so no build backend runs. Idempotent: nothing happens when the
# unpacked tree is there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VERSION=0.2.9
SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
DEST="$ROOT/.deps/xgrammar-$VERSION"

log() { echo "[fetch_xgrammar] $*"; }

if [[ -f "$DEST/include/xgrammar/xgrammar.h" ]]; then
  log "xgrammar $VERSION: present (${DEST#"$ROOT"/})"
  exit 0
fi
mkdir -p "$ROOT/.deps"
scratch="$(mktemp -d "$ROOT/.deps/xgrammar.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
log "xgrammar $VERSION: downloading the sdist from PyPI"
"$PY" - "$VERSION" "$SHA256" "$scratch/xgrammar.tar.gz" <<'PYEOF'
import hashlib, json, sys, urllib.parse, urllib.request
version, want, out = sys.argv[1:4]
api = "https://pypi.org/pypi/xgrammar/json"
meta = json.load(urllib.request.urlopen(api, timeout=60))
files = meta.get("releases", {}).get(version) or (meta["urls"] if meta["info"]["version"] == version else [])
sdists = [u for u in files if u["packagetype"] == "sdist"]
if not sdists:
    sys.exit(f"no sdist of xgrammar {version} on PyPI")
url = urllib.parse.urljoin(api, sdists[0]["url"])
data = urllib.request.urlopen(url, timeout=300).read()
have = hashlib.sha256(data).hexdigest()
if have != want:
    sys.exit(f"xgrammar sdist sha256 {have}, expected {want}")
open(out, "wb").write(data)
PYEOF
tar -xzf "$scratch/xgrammar.tar.gz" -C "$scratch"
rm -rf "$DEST"
mv "$scratch/xgrammar-$VERSION" "$DEST"
log "xgrammar $VERSION: unpacked into ${DEST#"$ROOT"/} (sha256 ok)"
