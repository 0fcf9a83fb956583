"""Quantized CPU kernel throughput vs a streaming read, same process, same threads.

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python benchmarks/kernels.py [--quick] [--types Q4_K,Q8_0]

Prints, for each type:
- matvec (M=1) effective GB/s = weight bytes / time, on a matrix too big for the caches,
  next to a 2-thread streaming read of a buffer of the same size (ratio = kernel / stream);
- the same on the real Gemma 3 270M shapes (mostly cache-resident, so ratios can pass 1);
- multi-row throughput in GFLOP/s (2*M*N*K / time) for M=8 (batched decode) and M=512
  (prefill), both the decode-16-rows + 4x4 micro-kernel path, next to numpy's float32 GEMM
  (OpenBLAS) on the same shape with the weights already in float;
- the same for the integer-dot kernel on repacked weights ("int8", backends/cpu/repack.py),
  the default CPU path on AVX-512 VNNI machines: M=1 time against the float matvec, M=8 and
  M=512 GFLOP/s, and the whole-model pass with both.
- attention (backends/cpu/attention.py) on Gemma 3 270M's shape (4 query heads on 1 KV head of
  256, f16 pool): the tiled kernel against the per-token one (paged_attention_ref, the same
  bits) for a 512- and a 2,048-token prefill (sliding window 512 and global) and a decode
  at 8K context; `--attention` runs only this section.
Every kernel figure is also given on one thread ("1T"): on a shared machine a 2-thread
parallel region waits for whichever thread was preempted, so 1T is the steadier number.
Absolute numbers drift run to run on shared machines; the ratios are what to compare.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import get_num_threads, njit, prange, set_num_threads

from edgeinfer.backends.cpu.matmul import QuantMatrix, matmul, numba_threads
from edgeinfer.backends.cpu.quants import random_quant_rows, row_bytes
from edgeinfer.backends.cpu.packed import packed_matmul
from edgeinfer.backends.cpu.repack import REPACKABLE, PackedMatrix
from edgeinfer.backends.cpu._simd import vadd, vhsum, vload, vzero

ALL = ["Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "F16", "BF16", "F32"]
# Gemma 3 270M shapes (K, N) per type as they occur in the Q4_K_M file
MODEL_SHAPES = {"Q8_0": (640, 262144), "Q5_0": (640, 2048), "Q4_K": (1024, 640), "Q6_K": (2048, 640)}


@njit(nogil=True, cache=True, parallel=True)
def _stream(buf):
    """Sum of a float32 buffer, 4 x 16 lanes per thread: a pure streaming read."""
    nch = 64
    per = buf.shape[0] // nch // 64 * 64
    tot = np.zeros(nch, np.float32)
    for c in prange(nch):
        a0 = vzero()
        a1 = vzero()
        a2 = vzero()
        a3 = vzero()
        for i in range(c * per, (c + 1) * per, 64):
            a0 = vadd(a0, vload(buf, i))
            a1 = vadd(a1, vload(buf, i + 16))
            a2 = vadd(a2, vload(buf, i + 32))
            a3 = vadd(a3, vload(buf, i + 48))
        tot[c] = vhsum(vadd(vadd(a0, a1), vadd(a2, a3)))
    return tot.sum()


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stream_gbs(nbytes: int, reps: int) -> float:
    buf = np.ones(nbytes // 4, np.float32)
    return nbytes / best_time(lambda: _stream(buf), reps) / 1e9


def on_threads(n: int, fn):
    old = get_num_threads()
    set_num_threads(min(n, old))
    try:
        return fn()
    finally:
        set_num_threads(old)


def matvec_gbs(qtype, K: int, N: int, reps: int, rng) -> tuple[float, float, float]:
    """(GB/s on all threads, its time, GB/s on one thread)."""
    w = QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)
    x = rng.standard_normal(K).astype(np.float32)
    out = np.empty((1, N), np.float32)
    t = best_time(lambda: matmul(x[None], w, out), reps)
    t1 = on_threads(1, lambda: best_time(lambda: matmul(x[None], w, out), reps))
    return w.nbytes / t / 1e9, t, w.nbytes / t1 / 1e9


def multirow_gflops(qtype, K: int, N: int, M: int, reps: int, rng,
                    packed: bool = False) -> tuple[float, float]:
    """(GFLOP/s on all threads, GFLOP/s on one thread); packed: the int8 kernel."""
    w = QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    out = np.empty((M, N), np.float32)
    if packed:
        p = PackedMatrix.from_quant(w)
        fn = lambda: packed_matmul(x, p, out)  # noqa: E731
    else:
        fn = lambda: matmul(x, w, out)  # noqa: E731
    t = best_time(fn, reps)
    t1 = on_threads(1, lambda: best_time(fn, reps))
    return 2.0 * M * N * K / t / 1e9, 2.0 * M * N * K / t1 / 1e9


def int8_matvec_ms(qtype, K: int, N: int, reps: int, rng) -> tuple[float, float, float]:
    """M=1: (float matvec ms, int8 ms, int8 bytes / GGUF bytes), all threads."""
    w = QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)
    p = PackedMatrix.from_quant(w)
    x = rng.standard_normal((1, K)).astype(np.float32)
    tf = best_time(lambda: matmul(x, w), reps)
    ti = best_time(lambda: packed_matmul(x, p), reps)
    return tf * 1e3, ti * 1e3, p.nbytes / w.nbytes


def model_pass(path: str, reps: int) -> None:
    """All 2-D weights of the real model as one forward pass would use them.

    decode: one matvec per matrix (the tied embedding as the output projection);
    prefill: M=512 for every block matrix, output projection for the last position only.
    Gives the matmul-only ceiling in tokens/s to set against llama.cpp's whole-model figures
    (~58 decode, ~560 prefill tok/s through llama-cpp-python on the reference machine).
    """
    from edgeinfer.formats.gguf_file import read_gguf

    g = read_gguf(path)
    mats = [QuantMatrix.from_gguf(g, n) for n, t in g.tensors.items() if len(t.shape) == 2]
    rng = np.random.default_rng(1)
    xs = {w.K: rng.standard_normal((512, w.K)).astype(np.float32) for w in mats}
    nbytes = sum(w.nbytes for w in mats)
    print(f"\nwhole model, matmuls only ({len(mats)} matrices, {nbytes / 1e6:.0f} MB)")
    packed = [PackedMatrix.from_quant(w) if int(w.qtype) in REPACKABLE else w for w in mats]
    for label, ws in (("float", mats), ("int8", packed)):
        out_proj = max(ws, key=lambda w: w.N)
        blocks = [w for w in ws if w is not out_proj]

        def mm(x, w):
            return packed_matmul(x, w) if isinstance(w, PackedMatrix) else matmul(x, w)

        def decode(rows=1):
            for w in blocks:
                mm(xs[w.K][:rows], w)
            mm(xs[out_proj.K][:rows], out_proj)

        def prefill():
            for w in blocks:
                mm(xs[w.K], w)
            mm(xs[out_proj.K][:1], out_proj)

        td = best_time(decode, reps)
        td1 = on_threads(1, lambda: best_time(decode, reps))
        t8 = best_time(lambda: decode(8), reps)
        tp = best_time(prefill, max(2, reps // 4))
        tp1 = on_threads(1, lambda: best_time(prefill, max(2, reps // 4)))
        print(f"{label:5} decode : {td * 1e3:7.2f} ms/token = {1 / td:6.1f} tok/s"
              f"   1T: {1 / td1:6.1f} tok/s   8 rows: {t8 * 1e3:6.2f} ms = {8 / t8:6.1f} tok/s"
              f" ({td * 8 / t8:.2f}x one row)")
        print(f"{label:5} prefill: {tp * 1e3:7.1f} ms/512  = {512 / tp:6.1f} tok/s"
              f"   1T: {512 / tp1:6.1f} tok/s")


# (query tokens, context before them, window): Gemma 3's local layers have a window of 512
ATTENTION_CASES = {"prefill 512": (512, 0, 512), "prefill 2048, window 512": (2048, 0, 512),
                   "prefill 2048, global": (2048, 0, 0), "decode at 8K, global": (1, 8192, 0),
                   "decode at 8K, window 512": (1, 8192, 512)}


def attention_inputs(nq: int, ctx: int, window: int, rng, H=4, KVH=1, D=256, bs=16):
    """One sequence of ctx + T positions in a shuffled f16 pool; queries at the last T."""
    nblk = (ctx + nq + bs - 1) // bs
    shape = (nblk, bs, KVH, D)
    kc = rng.standard_normal(shape).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal(shape).astype(np.float16).view(np.uint16)
    tables = rng.permutation(nblk).astype(np.int32).reshape(1, -1)
    q = rng.standard_normal((nq, H, D)).astype(np.float32)
    pos = np.arange(ctx, ctx + nq, dtype=np.int32)
    return q, kc, vc, tables, np.zeros(nq, np.int32), pos, window


def attention_section(rounds: int, rng) -> None:
    """Tiled vs per-token attention, interleaved rounds: median ms (range) and the FLOP rate
    (q.k and the V sum, 4 FLOPs per query head, key and dimension)."""
    from statistics import median

    from edgeinfer.backends.cpu.attention import heads_per_item, paged_attention, paged_attention_ref
    print(f"\nattention, Gemma 3 270M shape (4 heads on 1 KV head, D=256, f16 pool), "
          f"median of {rounds} interleaved rounds (range)")
    print(f"{'case':26} {'threads':>7} {'per-token ms':>22} {'tiled ms':>22} {'speed-up':>8} {'tiled GFLOP/s':>13}")
    for name, (nq, ctx, window) in ATTENTION_CASES.items():
        args = attention_inputs(nq, ctx, window, rng)
        q, pos = args[0], args[5]
        keys = sum(p + 1 - (max(0, p - window + 1) if window > 0 else 0) for p in pos.tolist())
        flops = 4.0 * q.shape[1] * q.shape[2] * keys
        for threads in sorted({numba_threads(), 1}, reverse=True):
            def run(fn):
                out = np.empty_like(q)
                nh = heads_per_item(nq, q.shape[1], 1, threads)
                t0 = time.perf_counter()
                fn(*args, np.float32(0.0625), True, out, threads > 1, nh)
                return time.perf_counter() - t0
            times = {paged_attention_ref: [], paged_attention: []}
            on_threads(threads, lambda: [run(f) for f in times])          # compile, warm
            n = rounds if nq < 1024 else max(3, rounds // 2)
            for _ in range(n):
                for f in times:
                    times[f].append(on_threads(threads, lambda: run(f)))
            ref, new = times[paged_attention_ref], times[paged_attention]
            print(f"{name:26} {threads:7d} {median(ref) * 1e3:8.2f} ({min(ref) * 1e3:.2f}-{max(ref) * 1e3:.2f})"
                  f" {median(new) * 1e3:8.2f} ({min(new) * 1e3:.2f}-{max(new) * 1e3:.2f})"
                  f" {median(ref) / median(new):7.2f}x {flops / median(new) / 1e9:13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", action="store_true", help="only the attention section")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller big matrices")
    ap.add_argument("--types", default=",".join(ALL))
    ap.add_argument("--big-mb", type=float, default=96.0, help="size of the out-of-cache matrix")
    ap.add_argument("--model", default=None, help="GGUF for the whole-model section "
                    "(default: the bundled Gemma 3 270M if it is assembled)")
    args = ap.parse_args()
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    reps = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    print(f"threads={numba_threads()}")
    if args.attention:
        attention_section(5 if args.quick else 9, rng)
        return

    print("\nmatvec M=1, out-of-cache matrix")
    print(f"{'type':6} {'K':>5} {'N':>7} {'MB':>7} {'ms':>8} {'GB/s':>7} {'stream':>7} {'ratio':>6} {'1T GB/s':>8}")
    for name in types:
        qt = T[name]
        K = 640 if name == "Q8_0" else 2048
        N = 262144 if name == "Q8_0" else int(args.big_mb * 1e6 / row_bytes(qt, K)) // 64 * 64
        if args.quick:
            N //= 4
        gbs, t, g1 = matvec_gbs(qt, K, N, reps, rng)
        s = stream_gbs(N * row_bytes(qt, K), reps)
        print(f"{name:6} {K:5d} {N:7d} {N * row_bytes(qt, K) / 1e6:7.1f} {t * 1e3:8.3f} {gbs:7.2f} {s:7.2f} {gbs / s:6.2f} {g1:8.2f}")

    print("\nmatvec M=1, Gemma 3 270M shapes")
    print(f"{'type':6} {'K':>5} {'N':>7} {'MB':>7} {'us':>8} {'GB/s':>7} {'stream':>7} {'ratio':>6} {'1T GB/s':>8}")
    for name, (K, N) in MODEL_SHAPES.items():
        if name not in types:
            continue
        qt = T[name]
        gbs, t, g1 = matvec_gbs(qt, K, N, reps * 4, rng)
        s = stream_gbs(N * row_bytes(qt, K), reps * 4)
        print(f"{name:6} {K:5d} {N:7d} {N * row_bytes(qt, K) / 1e6:7.2f} {t * 1e6:8.1f} {gbs:7.2f} {s:7.2f} {gbs / s:6.2f} {g1:8.2f}")

    K, N = 2048, 2048
    wf = rng.standard_normal((N, K), dtype=np.float32)
    blas = {}
    for M in (8, 512):
        xf = rng.standard_normal((M, K)).astype(np.float32)
        blas[M] = 2.0 * M * N * K / best_time(lambda: xf @ wf.T, reps) / 1e9
    print(f"\nmulti-row GFLOP/s, K={K} N={N} (numpy f32 GEMM: M=8 {blas[8]:.1f}, M=512 {blas[512]:.1f})")
    print(f"{'type':6} {'M=8':>8} {'1T':>6} {'M=512':>8} {'1T':>6} | {'int8 M=8':>8} {'1T':>6} "
          f"{'M=512':>8} {'1T':>6} | {'M=1 ms float':>12} {'int8':>6} {'bytes':>6}")
    for name in types:
        qt = T[name]
        g8, g8s = multirow_gflops(qt, K, N, 8, reps, rng)
        g512, g512s = multirow_gflops(qt, K, N, 512, max(3, reps // 3), rng)
        line = f"{name:6} {g8:8.1f} {g8s:6.1f} {g512:8.1f} {g512s:6.1f}"
        if int(qt) in REPACKABLE:
            i8, i8s = multirow_gflops(qt, K, N, 8, reps, rng, packed=True)
            i512, i512s = multirow_gflops(qt, K, N, 512, max(3, reps // 3), rng, packed=True)
            tf, ti, ratio = int8_matvec_ms(qt, K, N, reps, rng)
            line += (f" | {i8:8.1f} {i8s:6.1f} {i512:8.1f} {i512s:6.1f} | {tf:12.3f} {ti:6.3f}"
                     f" {ratio:5.2f}x")
        print(line)

    attention_section(5 if args.quick else 9, rng)

    path = args.model or _bundled_model()
    if path:
        model_pass(path, reps)


def _bundled_model() -> str | None:
    from pathlib import Path
    p = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "gemma-3-270m-q4_k_m.gguf"
    return str(p) if p.exists() else None


if __name__ == "__main__":
    main()
