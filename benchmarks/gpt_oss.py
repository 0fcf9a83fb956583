"""gpt-oss prefill and decode against llama.cpp: a synthetic gpt-oss GGUF (tests/synth_archs.py
"gpt-oss-bench": 8 layers of width 768, 16 experts of 768 with 4 used, sinks, a 128-token
window on even layers, YaRN) quantized by llama.cpp's own quantizer with MXFP4_MOE (experts
MXFP4, read in place by backends/cpu/mxfp4.py; attention and head Q8_0), then
benchmarks/generate.py on it (interleaved rounds, medians, llama.cpp in the same run).

    .venv/bin/python benchmarks/gpt_oss.py [--rounds 3] [--depths 0,2048]

The file (128 MB) is built once under .cache/bench-gpt-oss/ (the 0.9 GB F32 intermediate is
deleted after quantizing).
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
    add_run_args(ap)
    args = ap.parse_args()
    from synth_archs import VARIANTS, variant_model
    cache = ROOT / ".cache" / "bench-gpt-oss"
    v = VARIANTS["gpt-oss-bench"]
    path = variant_model(cache, "gpt-oss-bench", "MXFP4_MOE")
    (cache / "synth-gpt-oss-bench-F32.gguf").unlink(missing_ok=True)
    print(f"synthetic gpt-oss MXFP4_MOE: {v.layers} layers, width {v.n_embd}, {v.n_expert} "
          f"experts of {v.n_ff_exp}, {v.n_expert_used} used, window {v.sliding_window}; "
          f"{path.stat().st_size / 2**20:.0f} MB", flush=True)
    return run_on(path, args)


if __name__ == "__main__":
    raise SystemExit(main())
