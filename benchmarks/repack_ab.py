"""The repacked int8 tile kernel of the working tree against a git revision's, same process.

    .venv/bin/python benchmarks/repack_ab.py --base 7c317cb [--rounds 5] [--rows 1,8,512]

Loads backends/cpu/_int8.py and repack.py as they were at --base into a scratch package
(/tmp/edgeinfer-ab-<base>), repacks every matrix of the bundled Gemma 3 270M with both, and:
- prints bytes per decoded token: the GGUF's matrices, the base's repacked, ours;
- checks that both kernels give the same bits on every matrix (one activation quantization,
  shared, so only the tile kernels differ);
- times a whole-model matmul pass (every matrix once, the output head included: a decode
  token's matmuls; M rows each) for each --rows, base and ours alternating in rounds, and
  prints the median and range of each and the ratio of medians.
Timings on a shared machine drift: read the ratio, within one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

from common import cpu_modules_at
from edgeinfer.backends.cpu import _actquant, _int8
from edgeinfer.backends.cpu.quants import QuantMatrix
from edgeinfer.backends.cpu.repack import REPACKABLE, PackedMatrix

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "test-models" / "gemma-3-270m-q4_k_m.gguf"


def load_base(rev: str):
    """(_int8, repack) modules of revision rev, importable side by side with ours."""
    return tuple(cpu_modules_at(rev, "_int8", "repack"))


def codes_for(x, p):
    M, K = x.shape
    nb = K // p.B
    qa = np.empty((M, K), np.int8)
    da = np.empty((nb, M), np.float32)
    bsf = np.empty((nb, M), np.float32)
    zb = np.empty((nb, M), np.int32)
    _actquant.quantize_rows(x, p.A, p.B, p.zero_point, qa, da, bsf, zb, False)
    return qa, da, bsf, zb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the old kernel")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="passes per round (best of them)")
    ap.add_argument("--rows", default="1,8,512")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--isa", default=None, help="our tile kernel: avx512vnni, avxvnni, avx2 "
                    "(default: this CPU's best; the base's is its VNNI one)")
    args = ap.parse_args()
    old8, oldrp = load_base(args.base)
    from edgeinfer.formats.gguf_file import read_gguf

    g = read_gguf(args.model)
    mats = [QuantMatrix.from_gguf(g, n) for n, t in g.tensors.items()
            if len(t.shape) == 2 and int(t.ggml_type) in REPACKABLE]
    old = [oldrp.PackedMatrix.from_quant(w) for w in mats]
    new = [PackedMatrix.from_quant(w) for w in mats]
    gguf_b = sum(w.nbytes for w in mats)
    old_b = sum(p.nbytes for p in old)
    new_b = sum(p.nbytes for p in new)
    print(f"bytes per decoded token (every matrix once): GGUF {gguf_b / 1e6:.1f} MB, "
          f"base {old_b / 1e6:.1f} MB ({old_b / gguf_b:.3f}x), ours {new_b / 1e6:.1f} MB "
          f"({new_b / gguf_b:.3f}x)")
    by_type: dict[str, list[int]] = {}
    for w, po, pn in zip(mats, old, new):
        e = by_type.setdefault(w.qtype.name, [0, 0, 0])
        e[0] += w.nbytes
        e[1] += po.nbytes
        e[2] += pn.nbytes
    for name, (a, b, c) in by_type.items():
        print(f"  {name:5} GGUF {a / 1e6:7.1f} MB  base {b / 1e6:7.1f} MB  ours {c / 1e6:7.1f} MB"
              f"  (ours/GGUF {c / a:.3f})")
    nw = numba.get_num_threads()
    vnni = _int8.HAVE_VNNI
    ours = args.isa or True
    rng = np.random.default_rng(0)
    for M in [int(r) for r in args.rows.split(",")]:
        xs = {w.K: rng.standard_normal((M, w.K)).astype(np.float32) for w in mats}
        work = []
        for w, po, pn in zip(mats, old, new):
            rows = 1 if (M > 8 and w.N > 100000) else M      # prefill: the head for one row
            qa, da, bsf, zb = codes_for(np.ascontiguousarray(xs[w.K][:rows]), pn)
            work.append((po, pn, qa, da, bsf, zb, np.empty((rows, w.N), np.float32),
                         np.empty((rows, w.N), np.float32)))

        def run_old():
            for po, pn, qa, da, bsf, zb, oo, _on in work:
                t = nw if qa.shape[0] * po.K * po.N >= 1 << 18 else 1
                old8.int8_matmul(po.q, po.h, po.s, po.o, po.d, po.dm, po.fmt, qa, da, bsf, zb, oo,
                                 vnni, t, np.zeros(1, np.int64))

        def run_new():
            for po, pn, qa, da, bsf, zb, _oo, on in work:
                t = nw if qa.shape[0] * pn.K * pn.N >= 1 << 18 else 1
                _int8.int8_matmul(pn.q, pn.h, pn.s, pn.o, pn.d, pn.dm, pn.fmt, qa, da, bsf, zb, on, ours, t,
                                  np.zeros(1, np.int64))

        run_old()
        run_new()
        same = all(np.array_equal(oo.view(np.uint32), on.view(np.uint32)) for *_, oo, on in work)
        told, tnew = [], []
        for _ in range(args.rounds):
            for fn, ts in ((run_old, told), (run_new, tnew)):
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                ts.append(best)
        mo, mn = statistics.median(told), statistics.median(tnew)
        print(f"M={M:<4} same bits: {same}   base {mo * 1e3:8.2f} ms [{min(told) * 1e3:.2f}-"
              f"{max(told) * 1e3:.2f}]   ours {mn * 1e3:8.2f} ms [{min(tnew) * 1e3:.2f}-"
              f"{max(tnew) * 1e3:.2f}]   ours/base {mn / mo:.3f}   ({nw} threads, "
              f"base {'VNNI' if vnni else 'portable'}, ours {args.isa or 'best'})")


if __name__ == "__main__":
    main()
