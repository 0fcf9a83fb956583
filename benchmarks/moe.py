"""Mixture-of-experts prefill and decode against llama.cpp: a synthetic qwen3moe GGUF with
Qwen3-30B-A3B's routing (128 experts, 8 used a token) scaled to this machine's memory, written
in llama.cpp's layout and quantized by llama.cpp's own quantizer (tests/synth_archs.py), then
benchmarks/generate.py on it (interleaved rounds, medians, llama.cpp in the same run).

    .venv/bin/python benchmarks/moe.py [--ftype Q4_K_M] [--rounds 3] [--depths 0,2048]

The file is built once under .cache/bench-moe/ (about a minute).

Our side runs the grouped expert kernels (backends/cpu/experts.py, _moe.py): experts repacked
into one int8-tile array per tensor (237.5 MB for the file's 232.5 MB of expert tensors,
~1 s), one kernel call per layer for routing and the chosen experts. The two engines share a
2-core machine with whatever else runs on it: llama.cpp's spinning threads lose the most when
another program holds a core, so compare runs made at a low load average (printed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from generate import add_run_args, run_on  # noqa: E402  (this folder: the script's own)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftype", default="Q4_K_M", help="Q4_K_M, Q8_0 or F32")
    add_run_args(ap)
    args = ap.parse_args()
    from synth_archs import VARIANTS, variant_model
    v = VARIANTS["qwen3moe-bench"]
    path = variant_model(ROOT / ".cache" / "bench-moe", "qwen3moe-bench", args.ftype)
    print(f"synthetic qwen3moe {args.ftype}: {v.layers} layers, width {v.n_embd}, "
          f"{v.n_expert} experts of {v.n_ff_exp}, {v.n_expert_used} used; "
          f"{path.stat().st_size / 2**20:.0f} MB", flush=True)
    return run_on(path, args)


if __name__ == "__main__":
    raise SystemExit(main())
