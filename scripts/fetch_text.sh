#!/usr/bin/env bash
# Fetch the perplexity texts into data/text/ (git-ignored), each checked by SHA-256.
#
#   scripts/fetch_text.sh     # writes data/text/pride_and_prejudice.txt and data/text/emma.txt
#
# The texts: Jane Austen, "Pride and Prejudice" (1813) and "Emma" (1815), public domain (the
# author died in 1817; the transcriptions are Project Gutenberg's, with its licence header
# and footer already stripped). They come from the Debian package r-cran-janeaustenr 1.0.0-1
# (MIT for the R package; the novels themselves are public domain), which stores each novel
# as an R character vector, one element per line, in a lazy-load database
# (usr/lib/R/site-library/janeaustenr/data/Rdata.{rdx,rdb}). A small reader below decodes
# R's XDR serialization format (no R needed) and writes each novel's lines joined by "\n",
# UTF-8, ending in one "\n":
#   pride_and_prejudice.txt  13,030 lines, 684,768 bytes (~700 KB), ~165k SmolLM2 tokens
#   emma.txt                 16,235 lines, 883,028 bytes (~880 KB)
#
# Idempotent: a text whose file exists with the pinned hash is skipped; the .deb is
# downloaded once, and only if some text is missing or wrong. The .deb is pinned by version
# and SHA-256 (the hash Debian's Packages index lists), and so is each result.
# Env: TEXT_DIR (default <repo>/data/text), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TEXT_DIR="${TEXT_DIR:-$ROOT/data/text}"
PY="${PYTHON:-python3}"

DEB_PKG=r-cran-janeaustenr
DEB_VER=1.0.0-1
DEB_SHA=df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95
# One entry per text: name in data/text, R object name, sha256 of the written file.
TEXTS=(
  "pride_and_prejudice prideprejudice dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d"
  "emma                emma           7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe"
)

log() { echo "[fetch_text] $*"; }
die() { echo "[fetch_text] ERROR: $*" >&2; exit 1; }

# Which texts are missing or wrong?
todo=()
for entry in "${TEXTS[@]}"; do
  read -r name obj sha <<<"$entry"
  dest="$TEXT_DIR/$name.txt"
  if [[ -f "$dest" ]]; then
    have="$(sha256sum "$dest" | cut -d' ' -f1)"
    if [[ "$have" == "$sha" ]]; then
      log "$name: ok (sha256 matches), skipping"
      continue
    fi
    log "$name: sha256 mismatch (have $have, want $sha), re-fetching"
  fi
  todo+=("$entry")
done
[[ ${#todo[@]} -gt 0 ]] || exit 0

scratch="$(mktemp -d)"
tmps=()
trap 'rm -rf "$scratch" ${tmps[@]+"${tmps[@]}"}' EXIT

SUDO=()
[[ "$(id -u)" != 0 ]] && command -v sudo >/dev/null && SUDO=(sudo)
names="$(for entry in "${todo[@]}"; do read -r name _ <<<"$entry"; printf '%s ' "$name"; done)"
log "${names% }: downloading Debian package $DEB_PKG=$DEB_VER"
# apt-get download needs the package lists; a fresh machine may not have them yet.
if ! (cd "$scratch" && apt-get download -q "$DEB_PKG=$DEB_VER" >/dev/null 2>&1); then
  log "apt-get download failed; refreshing the package lists (apt-get update) and retrying"
  "${SUDO[@]}" apt-get update -q >/dev/null
  (cd "$scratch" && apt-get download -q "$DEB_PKG=$DEB_VER") || die "cannot download $DEB_PKG=$DEB_VER with apt-get"
fi
deb=("$scratch"/"${DEB_PKG}"_*.deb)
[[ -f "${deb[0]}" ]] || die "no .deb for $DEB_PKG in $scratch"
have="$(sha256sum "${deb[0]}" | cut -d' ' -f1)"
[[ "$have" == "$DEB_SHA" ]] || die "$(basename "${deb[0]}") has sha256 $have, expected $DEB_SHA"
dpkg-deb -x "${deb[0]}" "$scratch/root"

mkdir -p "$TEXT_DIR"
cat >"$scratch/read_rdata.py" <<'PYEOF'
# Reads one object of an R lazy-load database: <base>.rdx is a gzip'd serialized list
# (variables = name -> [offset, length] into <base>.rdb); each .rdb record is a 4-byte
# big-endian length and a zlib stream of one serialized object. Only the types these
# objects use are decoded (character/integer/double/logical vectors, lists, pairlists).
import gzip, struct, sys, zlib

class Reader:
    def __init__(self, b):
        self.b, self.p, self.refs = b, 0, []
        if self.raw(2) != b"X\n":
            sys.exit("not an XDR R serialization")
        version = self.int(); self.int(); self.int()
        if version == 3:
            self.raw(self.int())  # native encoding name

    def int(self):
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def raw(self, n):
        v = self.b[self.p:self.p + n]
        self.p += n
        return v

    def item(self, flags=None):
        f = self.int() if flags is None else flags
        t, has_attr, has_tag = f & 0xFF, f & (1 << 9), f & (1 << 10)
        if t in (241, 242, 247, 251, 252, 253, 254):  # environments, nil, missing
            return None
        if t == 255:  # reference to an earlier symbol
            return self.refs[(f >> 8) - 1]
        if t == 1:  # symbol
            s = self.item()
            self.refs.append(s)
            return s
        if t in (2, 239):  # pairlist: walk the CDR chain
            out = {}
            while True:
                if has_attr:
                    self.item()
                key = self.item() if has_tag else None
                out[key] = self.item()
                f = self.int()
                t, has_attr, has_tag = f & 0xFF, f & (1 << 9), f & (1 << 10)
                if t == 254:
                    return out
                if t not in (2, 239):
                    sys.exit(f"unexpected R type {t} in a pairlist")
        if t == 9:  # one string
            n = self.int()
            return None if n == -1 else self.raw(n).decode("utf-8")
        if t in (10, 13):
            v = [self.int() for _ in range(self.int())]
        elif t == 14:
            n = self.int()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19):
            v = [self.item() for _ in range(self.int())]
        else:
            sys.exit(f"unsupported R type {t}")
        attrs = self.item() if has_attr else None
        if t == 19 and attrs and "names" in attrs:
            return dict(zip(attrs["names"], v))
        return v

base, name, out = sys.argv[1:4]
index = Reader(gzip.open(base + ".rdx").read()).item()
if name not in index["variables"]:
    sys.exit(f"{name} is not in {base}.rdx (has {sorted(index['variables'])})")
off, length = index["variables"][name]
with open(base + ".rdb", "rb") as f:
    f.seek(off)
    rec = f.read(length)
lines = Reader(zlib.decompress(rec[4:])).item()
if not isinstance(lines, list) or not all(isinstance(s, str) for s in lines):
    sys.exit(f"{name} is not a character vector")
with open(out, "w", encoding="utf-8", newline="\n") as f:
    f.write("\n".join(lines) + "\n")
PYEOF

for entry in "${todo[@]}"; do
  read -r name obj sha <<<"$entry"
  dest="$TEXT_DIR/$name.txt"
  tmp="$TEXT_DIR/.$name.txt.tmp.$$"
  tmps+=("$tmp")
  log "$name: decoding R object '$obj'"
  "$PY" "$scratch/read_rdata.py" "$scratch/root/usr/lib/R/site-library/janeaustenr/data/Rdata" "$obj" "$tmp"
  have="$(sha256sum "$tmp" | cut -d' ' -f1)"
  [[ "$have" == "$sha" ]] || die "$name: decoded text has sha256 $have, expected $sha"
  mv -f "$tmp" "$dest"
  log "$name: wrote $dest ($(stat -c %s "$dest") bytes, sha256 ok)"
done
