#!/usr/bin/env bash
# Fetch Debian's own source of the installed cpp-httplib (the same version and patches as
# libcpp-httplib.so) into .deps/ (git-ignored), for the TSan trees: run_sanitizers.sh tsan
# compiles it header-only with -fsanitize=thread instead of linking the uninstrumented library.
# TSan cannot see that library's inlined atomics and guarded statics, so its worker threads'
# memcmp/memcpy on memory another worker allocated were reported as races in an unrelated test
# now and then (docs/reliability.md, Sanitizers).
#
# The source package comes from the deb-src of the same Debian mirror, read through a private apt
# state under .deps/ (the system's sources and lists are not touched); apt checks its hashes
# against the signed index. Prints the include directory on stdout; idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "[fetch_httplib_source] $*" >&2; }

version="$(dpkg-query -W -f='${Version}' libcpp-httplib-dev 2>/dev/null || true)"
[[ -n "$version" ]] || { log "libcpp-httplib-dev is not installed (make deps)"; exit 1; }
DEST="$ROOT/.deps/cpp-httplib-$version"
if [[ -f "$DEST/include/httplib.h" ]]; then
  log "cpp-httplib $version: present (${DEST#"$ROOT"/})"
  echo "$DEST/include"
  exit 0
fi

mkdir -p "$ROOT/.deps"
scratch="$(mktemp -d "$ROOT/.deps/cpp-httplib.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/parts" "$scratch/lists/partial" "$scratch/cache/archives/partial"
# The binary packages' own sources, as deb-src (deb822 or one-line format).
if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
  sed 's/^Types:.*/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$scratch/parts/src.sources"
fi
if [[ -f /etc/apt/sources.list ]]; then
  sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > "$scratch/parts/src.list"
fi
apt_opts=(-o APT::Sandbox::User=root -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$scratch/parts"
          -o "Dir::State::Lists=$scratch/lists" -o "Dir::Cache=$scratch/cache")
log "cpp-httplib $version: fetching Debian's source package"
apt-get "${apt_opts[@]}" -qq update >&2
(cd "$scratch" && apt-get "${apt_opts[@]}" -qq source --download-only "cpp-httplib=$version" >&2)
dsc="$(ls "$scratch"/cpp-httplib_*.dsc)"
dpkg-source --no-check -x "$dsc" "$scratch/src" >&2  # applies debian/patches
rm -rf "$DEST"
mkdir -p "$DEST/include"
cp "$scratch/src/httplib.h" "$scratch/src/LICENSE" "$DEST/include/"
log "cpp-httplib $version: header-only httplib.h in ${DEST#"$ROOT"/}/include"
echo "$DEST/include"
