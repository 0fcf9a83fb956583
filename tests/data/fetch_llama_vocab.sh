#!/usr/bin/env bash
# Fetch llama.cpp's vocab-only GGUF files (+ .inp/.out expected ids) and its real chat templates
# from the llama-cpp-python source distribution on PyPI. They are the test data for our
# tokenizers and chat templates. Idempotent: returns at once when the data is already there.
#
#   tests/data/fetch_llama_vocab.sh            # into ${EDGEINFER_TEST_DATA:-<repo>/.cache/llama-vocab}
#   PYTHON=/path/to/python tests/data/fetch_llama_vocab.sh
set -euo pipefail

VERSION="0.3.36"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DEST="${EDGEINFER_TEST_DATA:-$REPO/.cache/llama-vocab}"
STAMP="$DEST/.complete-$VERSION"

if [[ -f "$STAMP" ]]; then
    echo "llama vocab test data already in $DEST"
    exit 0
fi

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

CACHE="$(dirname "$DEST")/sdist"
mkdir -p "$CACHE" "$DEST"
SDIST="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [[ -z "$SDIST" ]]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    SDIST="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz)"
fi

# Extract only models/ggml-vocab-* and models/templates/ (a few MB of a large archive).
"$PYTHON" - "$SDIST" "$DEST" <<'EOF'
import os, sys, tarfile
sdist, dest = sys.argv[1], sys.argv[2]
n = 0
with tarfile.open(sdist) as tar:
    for m in tar:
        parts = m.name.split("/")
        if not m.isfile() or "models" not in parts:
            continue
        rel = parts[parts.index("models") + 1:]
        if not rel or not (rel[0].startswith("ggml-vocab-") or rel[0] == "templates"):
            continue
        if any(p in ("", ".", "..") for p in rel):
            continue
        out = os.path.join(dest, *rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with tar.extractfile(m) as src, open(out + ".part", "wb") as dst:
            dst.write(src.read())
        os.replace(out + ".part", out)
        n += 1
if n == 0:
    sys.exit(f"no models/ggml-vocab-* files found in {sdist}")
print(f"extracted {n} files into {dest}")
EOF
touch "$STAMP"
