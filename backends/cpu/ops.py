"""The numba CPU backend: the `Ops` interface on numpy arrays with quantized weights."""
from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass

import numba
import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.backends.cpu import attention as A
from edgeinfer.backends.cpu import _geglu, _norm, _swiglu
from edgeinfer.backends.cpu import _rotate as _rot
from edgeinfer.backends.cpu import kernels as K
from edgeinfer.backends.cpu import _int8
from edgeinfer.backends.cpu import mxfp4 as _mx
from edgeinfer.backends.cpu._int8 import HAVE_SIMD
from edgeinfer.backends.cpu.experts import ExpertBank, Workspace, groupable
from edgeinfer.backends.cpu.matmul import QuantMatrix, matmul
from edgeinfer.backends.cpu.quants import get_rows, row_bytes
from edgeinfer.backends.cpu.packed import (SERIAL_QUANT, packed_matmul, packed_matmuls,
                                            packed_swiglu_matmul)
from edgeinfer.backends.cpu.packed_cache import PackedCache
from edgeinfer.backends.cpu.repack import REPACKABLE, PackedMatrix, packed_nbytes
from edgeinfer.backends.cpu_plan import (MXFP4_NOTE, packed_size, repacked_bytes,
                                         repacked_tensor)
from edgeinfer.backends import cpu_plan
from edgeinfer.backends.threads import ThreadGovernor
from edgeinfer.formats.ggml_types import GGMLQuantizationType, dequantize
from edgeinfer.formats.kv_cache_types import KV_BYTES_PER_VALUE, check_kv_cache_type


_Q = GGMLQuantizationType
# The activation format ggml's CPU backend quantizes to before each weight type's dot product.
_ACT_ROUNDING = {
    **{int(t): K.act_round_q8_0 for t in (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0)},
    **{int(t): K.act_round_q8_k for t in (_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)},
    int(_Q.F16): K.act_round_f16,
}


# Element counts below which an element-wise kernel runs on the calling thread (see kernels.py:
# starting a parallel region costs more than the work).
PAR_MIN_ELEMENTS = 1 << 15


def _par(elements: int) -> bool:
    return elements >= PAR_MIN_ELEMENTS and numba.get_num_threads() > 1


@dataclass
class CpuKVCache:
    """Per layer K and V pools [num_blocks, block_size, KVH, row]: IEEE half bit patterns
    (uint16) in the f16 pool, ggml q8_0 block bytes (uint8, row = D / 32 * 34) in the q8_0
    pool, float32 otherwise (kernels.py reads and writes all three)."""
    k: list[np.ndarray]
    v: list[np.ndarray]
    block_size: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class FileTable:
    """An embedding table read row by row from the GGUF file with pread, never mapped.

    Through the memory map, each row a token touches maps a whole page-cache folio (16 pages,
    or up to 2 MB with large folios): after a 2.7K-token prompt 86 of Qwen2.5 0.5B's 89 MB
    table was resident, and one 512-token prefill lookup mapped 60-100 MB. A pread per
    distinct token costs ~2 us, and the rows stay in the page cache."""

    def __init__(self, gguf_file, name: str):
        t = gguf_file.tensors[name]
        if len(t.shape) != 2:
            raise ValueError(f"tensor {name} has shape {t.shape}; a table needs two dimensions")
        self.qtype = GGMLQuantizationType(int(t.ggml_type))
        self.K, self.N = int(t.shape[0]), int(t.shape[1])
        self.row_bytes = row_bytes(self.qtype, self.K)
        self.offset = int(t.offset)
        self._fd = os.open(gguf_file.path, os.O_RDONLY)     # held: the file may be replaced
        weakref.finalize(self, os.close, self._fd)
        # decoded rows of recent one-token lookups (decode steps), oldest first: a step's
        # read, wrap and decode cost ~80 us with the caches cold from the layers' weights
        self._recent: dict[int, np.ndarray] = {}
        self._recent_max = max(1, self.RECENT_BYTES // (4 * self.K))

    RECENT_BYTES = 4 << 20

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size == 1:
            return self._row(int(ids[0]))
        if ids.size and (ids.min() < 0 or ids.max() >= self.N):
            raise IndexError(f"row id out of range [0, {self.N})")
        uniq, inverse = np.unique(ids, return_inverse=True)
        rb, fd, off = self.row_bytes, self._fd, self.offset
        raw = b"".join([os.pread(fd, rb, off + int(i) * rb) for i in uniq])
        if len(raw) != uniq.size * rb:
            raise OSError(f"short read of embedding rows from the model file (fd {fd})")
        w = QuantMatrix.from_bytes(np.frombuffer(raw, np.uint8), self.qtype, self.K, uniq.size)
        return get_rows(w, inverse.astype(np.int64))

    def _row(self, i: int) -> np.ndarray:
        """float32[1, K]: row i, a fresh copy (the caller may write it) of the decoded row,
        kept among the recent ones (the same decoder's bits as any lookup's)."""
        row = self._recent.get(i)
        if row is None:
            if not 0 <= i < self.N:
                raise IndexError(f"row id out of range [0, {self.N})")
            raw = os.pread(self._fd, self.row_bytes, self.offset + i * self.row_bytes)
            if len(raw) != self.row_bytes:
                raise OSError(f"short read of embedding rows from the model file (fd {self._fd})")
            w = QuantMatrix.from_bytes(np.frombuffer(raw, np.uint8), self.qtype, self.K, 1)
            row = get_rows(w, np.zeros(1, np.int64))
            if len(self._recent) >= self._recent_max:
                del self._recent[next(iter(self._recent))]
            self._recent[i] = row
        return row.copy()


def _zeroed_pages(shapes: list[tuple], dtype) -> list[np.ndarray]:
    """Zeroed arrays carved from one anonymous private mapping: the kernel hands out zero
    pages as they are first touched, so a KV pool costs neither a memset at load nor memory
    for the pages no sequence reached. (np.zeros goes through malloc, which takes blocks
    under its mmap threshold from the heap and clears them: in an engine process whose
    warm-up freed large arrays, the threshold had risen and the pool's 1 GB was cleared
    at every load, ~0.1 s.) The mapping goes when the last array does."""
    dtype = np.dtype(dtype)
    sizes = [int(np.prod(sh)) * dtype.itemsize for sh in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 4096) * 4096
    if total == 0:
        return [np.zeros(sh, dtype) for sh in shapes]
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return [np.frombuffer(mm, dtype, n // dtype.itemsize, off).reshape(sh) if n
            else np.zeros(sh, dtype) for sh, n, off in zip(shapes, sizes, offsets)]


class CpuOps:
    name = "cpu"
    kv_window_group = True          # sliding-window layers in a pool of their own (plan_kv)
    kv_bytes_per_value: float = 4   # per instance: 2 with the f16 pool, 34/32 with q8_0

    def __init__(self, numerics: str = "ggml", batch_invariant: bool = False,
                 repack: bool | None = None, governor: ThreadGovernor | None = None,
                 kv_cache_type: str | None = None, threads: int | None = None,
                 repack_cache: str | None = None, repack_cache_bytes: int = 0):
        """numerics="ggml" rounds activations, K/V and GELU as llama.cpp's CPU backend does
        (8-bit activation blocks per weight type, f16 K/V and GELU), so greedy text matches it
        token for token; "f32" keeps every intermediate in float32.

        repack: hold quantized weights in the integer-dot layout (repack.py) and multiply
        them with 8-bit activation codes by a vector tile kernel (AVX-512 VNNI, AVX-VNNI or
        AVX2). Every row's result is then the same whatever the batch size, and batched
        decode and prefill are several times faster. None (default) decides per model: on
        with ggml numerics on a CPU with such a kernel when the repacked weights take at most
        half of the RAM (Settings.repack, from EDGEINFER_REPACK=0/1, forces it).

        kv_cache_type: "f16" or "q8_0" (ggml's 8-bit blocks, 34 bytes per 32 values, as
        llama.cpp's --cache-type-k/v q8_0); None: f16 with ggml numerics, f32 with f32 ones.

        repack_cache: a directory that keeps repacked matrices (packed_cache.py): a model's
        next load maps them instead of repacking; at most repack_cache_bytes there. None: off.
        """
        if numerics not in ("ggml", "f32"):
            raise ValueError(f"numerics must be 'ggml' or 'f32', not {numerics!r}")
        self.numerics = numerics
        # Every row through the same kernel whatever the batch size, so a request's tokens do
        # not depend on what it was batched with (see matmul's batch_invariant). Packed
        # weights are batch-invariant by construction; this applies to the others.
        self.batch_invariant = batch_invariant
        # ggml numerics keep K/V in f16, as llama.cpp's default cache does: the pool stores
        # the halves themselves (half the memory and attention bandwidth of float32)
        if kv_cache_type is None:
            kv_cache_type = "f16" if numerics == "ggml" else "f32"
        elif kv_cache_type != "f32" or numerics != "f32":
            check_kv_cache_type(kv_cache_type)
        self.kv_cache_type = kv_cache_type
        self.kv_f16 = kv_cache_type == "f16"
        self.kv_bytes_per_value = KV_BYTES_PER_VALUE[kv_cache_type]
        if repack and numerics != "ggml":
            raise ValueError("repacked weights compute with 8-bit activations: numerics='ggml' only")
        self._repack_setting = repack
        self._cache_root, self._cache_bytes = repack_cache, repack_cache_bytes
        self.packed_cache = None        # the model's PackedCache, made on its first matrix
        self.repack: bool | None = None           # decided on the first matrix of a model
        # One governor per process (the model manager's), so two loaded models share the
        # cores instead of each taking all of them; a lone ops object makes its own.
        self.governor = governor
        self.threads = threads          # the lone-ops governor's fixed count (None: measured)
        # Rows that must be the one-row matvec's bits (a speculative verify's: the runner
        # sets it around such a forward when rows_exact is false). Repacked matrices give
        # every row those bits anyway; the others then take the per-row dot for any M.
        self.per_row = False
        self._unpacked = False          # some matrix was loaded without repacking
        self._mxfp4 = False             # some weights are MXFP4, read in place (mxfp4.py)
        self._moe_work = None           # scratch of the grouped expert kernels (experts.py)
        self._fused: dict = {}          # _layer's matrix tables, by the matrices (_fused_mats)

    # Drafts are verified exactly here: with rows_exact, any forward; otherwise the runner
    # runs the verified spans in a forward of their own with per_row set.
    exact_drafts = True

    @property
    def rows_exact(self) -> bool:
        """Whether every row of any forward gets the bits it would get alone: every matrix
        is repacked (the int8 tile kernels compute a row the same way for any row count,
        _int8.py), or batch_invariant. Otherwise a matmul of more than FEW_ROWS rows takes
        the register-blocked kernel, which rounds differently from the one-row matvec."""
        return self.batch_invariant or not self._unpacked

    def weights_nbytes(self, gguf_file) -> int:
        """Repacked matrices at their tile size, the rest as the GGUF holds them."""
        if not self.would_repack(gguf_file):
            return sum(t.nbytes for t in gguf_file.tensors.values())
        return sum(packed_size(t) if repacked_tensor(gguf_file, name) else t.nbytes
                   for name, t in gguf_file.tensors.items())

    def fit_kv_budget(self, gguf_file, requested: int) -> int:
        """The CPU pool lives in RAM beside the weights; the model manager checks free memory
        before a load, so the request stands."""
        return requested

    def decode_graphs(self, model, kv) -> None:
        """None: a decode step here is a few numba calls per layer, nothing to record."""
        return None

    def begin_step(self) -> None:
        """Called by the runner before each forward, on the thread that runs it."""
        if self.governor is None:       # a lone ops object (scripts, tests): its own budget
            self.governor = ThreadGovernor(fixed=self.threads)
        self.governor.update()

    @property
    def weights_copied(self) -> bool:
        """Whether the model's weights were copied out of the GGUF's memory map."""
        return bool(self.repack)

    @property
    def weights_format(self) -> str:
        return cpu_plan.weights_format(bool(self.repack), _int8.BEST_ISA) + \
            (MXFP4_NOTE if self._mxfp4 else "")

    # -- weights ---------------------------------------------------------------------------
    def would_repack(self, gguf_file) -> bool:
        """Whether this model's weights would be repacked (see __init__), without loading."""
        return cpu_plan.would_repack(gguf_file, self._repack_setting, self.numerics,
                                     _int8.BEST_ISA)

    def weights_format_for(self, gguf_file) -> str:
        """The weights_format a model from this file would report."""
        return cpu_plan.weights_format_for(gguf_file, self._repack_setting, self.numerics,
                                           _int8.BEST_ISA)

    def matrix(self, gguf_file, name: str) -> QuantMatrix | PackedMatrix | _mx.Mxfp4Matrix:
        if self.repack is None:
            self.repack = self.would_repack(gguf_file)
        gtype = int(gguf_file.tensors[name].ggml_type)
        if gtype == _mx.MXFP4:
            # read in place by its own kernel, every row the same bits in any batch
            self._mxfp4 = True
            return _mx.Mxfp4Matrix.from_gguf(gguf_file, name)
        if self.repack and gtype in REPACKABLE:
            cache = self._packed_cache(gguf_file)
            packed = cache.get(name) if cache is not None else None
            if packed is not None:
                return packed
            packed = PackedMatrix.from_quant(QuantMatrix.from_gguf(gguf_file, name))
            gguf_file.release_pages(name)      # keeps peak RSS near one copy of the weights
            if cache is not None:
                cache.put(name, packed)
            return packed
        w = QuantMatrix.from_gguf(gguf_file, name)
        self._unpacked = True
        return w

    def release(self) -> None:
        """An unload (the engine process ends next) finishes writing the repacked weights
        to disk, or the next load would repack them again."""
        if self.packed_cache is not None:
            self.packed_cache.flush()

    def _packed_cache(self, gguf_file):
        if self.packed_cache is None and self._cache_root:
            self.packed_cache = PackedCache(self._cache_root, gguf_file.path, self._cache_bytes)
        return self.packed_cache

    def table(self, gguf_file, name: str) -> FileTable:
        """A matrix only ever read by rows (an embedding not tied to the output head): left
        in the GGUF file instead of repacked in memory (Qwen2.5 0.5B: 89 MB)."""
        return FileTable(gguf_file, name)

    def vector(self, gguf_file, name: str) -> np.ndarray:
        t = gguf_file.tensors[name]
        raw = gguf_file.raw(name)
        if t.ggml_type == GGMLQuantizationType.F32:
            return np.frombuffer(raw, dtype=np.float32).copy()
        return dequantize(raw, t.ggml_type).reshape(-1).astype(np.float32)

    # -- element-wise ----------------------------------------------------------------------
    def embed(self, table: QuantMatrix | PackedMatrix | FileTable,
              ids: np.ndarray) -> np.ndarray:
        if isinstance(table, (PackedMatrix, FileTable)):
            return table.rows(ids)
        return get_rows(table, ids)

    def matmul(self, x: np.ndarray, w: QuantMatrix | PackedMatrix | _mx.Mxfp4Matrix) -> np.ndarray:
        if isinstance(w, _mx.Mxfp4Matrix):     # Q8_0 activations, as ggml (mxfp4.py)
            return _mx.matmul(x, w, q8=self.numerics == "ggml")
        if isinstance(w, PackedMatrix):
            if self.numerics != "ggml":
                raise ValueError("repacked weights compute with 8-bit activations: numerics='ggml' only")
            out = packed_matmul(x.reshape(-1, x.shape[-1]), w)
            return out.reshape(w.N) if x.ndim == 1 else out
        if self.numerics == "ggml":
            rounder = _ACT_ROUNDING.get(int(w.qtype))
            if rounder is not None:
                x2 = x.reshape(-1, x.shape[-1])
                x = rounder(x2, np.empty_like(x2))
        return matmul(x, w, batch_invariant=self.batch_invariant, per_row=self.per_row)

    def matmuls(self, x: np.ndarray, ws) -> tuple:
        """(x @ W^T for W in ws): the same bits as a matmul each, with repacked weights the
        input quantized once per activation format instead of once per matrix."""
        if self.numerics == "ggml" and all(isinstance(w, PackedMatrix) for w in ws):
            outs = packed_matmuls(x.reshape(-1, x.shape[-1]), ws)
            return tuple(o.reshape(o.shape[1]) for o in outs) if x.ndim == 1 else tuple(outs)
        return tuple(self.matmul(x, w) for w in ws)

    # -- a decoder layer's small ops fused (_layer.py) --------------------------------------
    def fused_layer_rows(self, T: int, width: int, mats) -> bool:
        """Whether norm_qkv / out_add_norm take a step of T rows whose widest activation has
        `width` values, with these matrices: every one repacked (ggml numerics), and a step
        small enough that the separate ops would run their norms and quantization on the
        calling thread anyway (the fused kernels run everything but the tiles there)."""
        return (self.numerics == "ggml" and T * width < min(PAR_MIN_ELEMENTS, SERIAL_QUANT)
                and all(isinstance(w, PackedMatrix) for w in mats))

    def _fused_mats(self, mats) -> tuple:
        """(P, Wt) of _layer's kernels for these repacked matrices, made once per tuple."""
        key = tuple(id(w) for w in mats)
        got = self._fused.get(key)
        if got is None:
            isa = _int8.BEST_ISA if HAVE_SIMD else _int8.PORTABLE
            P = np.array([[_int8.kernel_address(w.fmt, isa), w.A, w.B, w.zero_point, w.N]
                          for w in mats], np.int64)
            Wt = np.ascontiguousarray(np.stack([w.W for w in mats]))
            got = self._fused[key] = (P, Wt, tuple(mats))     # the matrices: ids stay theirs
        return got

    def norm_qkv(self, x: np.ndarray, y: np.ndarray | None, w_norm: np.ndarray, eps: float,
                 mats, heads: tuple[int, int], q_norm: np.ndarray, k_norm: np.ndarray,
                 batch: ForwardBatch, base: float, scale: float, neox: bool, freq_factors,
                 threads: int) -> tuple:
        """x += y (when y is given) in place; h = rms_norm(x, w_norm); q, k, v = h times the
        three matrices (wq, wk, wv); then norm_rope of q (heads[0] heads) with q_norm and of k
        (heads[1]) with k_norm. The bits of those ops, in one call (fused_layer_rows)."""
        from edgeinfer.backends.cpu.fused import FusedQKV
        x2 = x.reshape(-1, x.shape[-1])
        cos, sin = self._rope_tables(batch, q_norm.shape[0], base, scale, freq_factors)
        return FusedQKV(self, w_norm, eps, mats, heads, q_norm, k_norm, neox)(
            x2, None if y is None else y.reshape(x2.shape), cos, sin, threads)

    def out_add_norm(self, a: np.ndarray, wo, x: np.ndarray, w_norm: np.ndarray, eps: float,
                     threads: int) -> np.ndarray:
        """x += a times wo, in place; returns rms_norm(x, w_norm): the bits of matmul, add
        and rms_norm, in one call (fused_layer_rows)."""
        from edgeinfer.backends.cpu.fused import FusedOut
        x2 = x.reshape(-1, x.shape[-1])
        h = FusedOut(self, wo, w_norm, eps)(a.reshape(-1, a.shape[-1]), x2, threads)
        return h.reshape(x.shape)

    def fused_layer(self, attn_norm: np.ndarray, eps: float, qkv, heads: tuple[int, int],
                    q_norm: np.ndarray | None, k_norm: np.ndarray | None, neox: bool, wo,
                    ffn_norm: np.ndarray, bank: ExpertBank | None = None,
                    head_dim: int | None = None, biases=None, ffn=None):
        """A layer's norm_qkv, out_add_norm and (a grouped bank with an F32 router) moe
        with their arguments bound once (fused.FusedLayer): the same calls, less Python.
        Without QK-norm (q_norm None: head_dim given) the q/k/v step is add_bias (biases:
        (bq, bk, bv) or None) and rope instead (_layer.norm_qkv_rope). ffn: a SwiGLU FFN's
        (gate, up, down), run with out_add_norm in one call (FusedLayer.attn_out_ffn)."""
        from edgeinfer.backends.cpu.fused import FusedLayer
        return FusedLayer(self, attn_norm, eps, qkv, heads, q_norm, k_norm, neox, wo, ffn_norm,
                          bank, head_dim, biases, ffn)

    def fused_head(self, norm: np.ndarray, eps: float, output):
        """The residual add, final norm and output matrix of a step whose every row wants
        logits, in one call (fused.FusedHead), or None when the output matrix is not
        repacked (fused_layer_rows)."""
        from edgeinfer.backends.cpu.fused import FusedHead
        if not self.fused_layer_rows(1, output.K, (output,)):
            return None
        return FusedHead(self, norm, eps, output)

    def layer_step(self, batch: ForwardBatch, H: int, KVH: int, D: int, scale: float,
                   rope_base: float, rope_scale: float, freq_factors=None):
        """What every layer of this step shares, made once (fused.LayerStep): the rope
        tables (cos, sin), the thread count, and attend(q, k, v, cache, layer), which is
        ops.attention(q, k, v, cache, layer, batch, scale, 0) with its per-step choices
        made here instead of in every layer."""
        from edgeinfer.backends.cpu.fused import LayerStep
        return LayerStep(self, batch, H, KVH, D, scale, rope_base, rope_scale, freq_factors,
                         numba.get_num_threads())

    # -- mixture of experts (models/qwen3moe.py) ------------------------------------------
    def expert_bank(self, gguf_file, prefix: str, grouped: bool = True) -> ExpertBank:
        """A layer's router and experts (experts.py): grouped int8 tiles run by moe_ffn
        when asked for, this model's weights are repacked and the experts' type allows; else
        one matrix per expert (bank.gate[e], ...), for the model to run expert by expert."""
        if self.repack is None:
            self.repack = self.would_repack(gguf_file)
        grouped = grouped and bool(self.repack) and groupable(gguf_file, prefix)
        if self._moe_work is None:          # one scratch for the model's layers
            self._moe_work = Workspace()
        return ExpertBank(self, gguf_file, prefix, grouped,
                          _int8.BEST_ISA if HAVE_SIMD else _int8.PORTABLE, self._moe_work)

    def moe_route(self, bank: ExpertBank, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids int64[T, k], weights float32[T, k]) per token: softmax over the router
        logits, the top k (ties: the lower index), renormalized; each row's bits as alone."""
        rounder = _ACT_ROUNDING.get(int(bank.router.qtype)) if self.numerics == "ggml" else None
        return bank.route(h, k, rounder)

    def moe_ffn(self, bank: ExpertBank, h: np.ndarray, ids: np.ndarray,
                weights: np.ndarray) -> np.ndarray:
        """float32[T, X]: sum over slots j of weights[t, j] * (expert ids[t, j]'s SwiGLU FFN
        of h[t]), added slot by slot, by a grouped bank (bank.grouped)."""
        if bank.grouped is None:
            raise ValueError("moe_ffn runs a grouped expert bank; this one is per expert")
        return bank.grouped(h, np.ascontiguousarray(ids, dtype=np.int64),
                            np.ascontiguousarray(weights, dtype=np.float32))

    def moe(self, bank: ExpertBank, h: np.ndarray, k: int) -> np.ndarray:
        """moe_ffn(bank, h, *moe_route(bank, h, k)), the same bits, in one kernel call."""
        if bank.grouped is None:
            raise ValueError("moe runs a grouped expert bank; this one is per expert")
        rounder = _ACT_ROUNDING.get(int(bank.router.qtype)) if self.numerics == "ggml" else None
        return bank.run(h, k, rounder)[0]

    def expert_tensor(self, gguf_file, name: str) -> _mx.Mxfp4Experts | None:
        """A 3-D expert tensor this backend multiplies grouped and in place (MXFP4: gpt-oss's
        experts, mxfp4.py), or None: the model then runs its experts one by one."""
        if self.numerics == "ggml" and int(gguf_file.tensors[name].ggml_type) == _mx.MXFP4:
            self._mxfp4 = True
            return _mx.Mxfp4Experts.from_gguf(gguf_file, name)
        return None

    def expert_matmuls(self, x: np.ndarray, banks, starts: np.ndarray,
                       experts: np.ndarray) -> list:
        """For each bank of expert_tensor: float32[R, N], rows starts[g]..starts[g + 1]-1 of
        x (grouped by expert) times expert experts[g]'s matrix; a chosen expert's rows are
        decoded once for its group, an unchosen one never read; each row the bits of a
        matmul of its own."""
        return _mx.grouped_matmuls(x, banks, starts, experts)

    def add_bias(self, x: np.ndarray, b: np.ndarray) -> np.ndarray:
        x += b
        return x

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """Normalizes over the last axis (rows of hidden states, or heads of q/k)."""
        flat = x.reshape(-1, x.shape[-1])
        # eight rows at a time: the bits of K.rms_norm, about twice as fast (_norm.py)
        return _norm.rms_norm(flat, w, eps, np.empty_like(flat), _par(flat.size)).reshape(x.shape)

    def add_rms_norm(self, x: np.ndarray, a: np.ndarray, w_a: np.ndarray, w_x: np.ndarray,
                     eps: float) -> np.ndarray:
        """x += rms_norm(a, w_a) in place (a is overwritten); returns rms_norm(x, w_x). The
        bits of the three ops, in one call."""
        x2, a2 = x.reshape(-1, x.shape[-1]), a.reshape(-1, a.shape[-1])
        h = _norm.add_rms_norm(x2, a2, w_a, w_x, eps, np.empty_like(x2), _par(x2.size))
        return h.reshape(x.shape)

    @staticmethod
    def _rope_tables(batch: ForwardBatch, D: int, base: float, scale: float, freq_factors):
        key = ("rope", base, scale, D)
        tables = batch.cache.get(key)
        if tables is None:
            # One table per (step, base): computed by the first layer, reused by the rest.
            tables = K.rope_tables(batch.positions, D, base, scale, freq_factors)
            batch.cache[key] = tables
        return tables

    def rope(self, x: np.ndarray, batch: ForwardBatch, base: float, scale: float, neox: bool,
             freq_factors=None) -> np.ndarray:
        cos, sin = self._rope_tables(batch, x.shape[-1], base, scale, freq_factors)
        K.rope_inplace(x, cos, sin, neox, _par(x.size))
        return x

    def norm_rope(self, x: np.ndarray, w: np.ndarray, eps: float, batch: ForwardBatch,
                  base: float, scale: float, neox: bool, freq_factors=None) -> np.ndarray:
        """rope(rms_norm(x, w)) on x[T, H, D], in place: the bits of the two ops, one call."""
        cos, sin = self._rope_tables(batch, x.shape[-1], base, scale, freq_factors)
        return _norm.norm_rope(x, w, eps, cos, sin, neox, _par(x.size))

    def geglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.numerics == "ggml":
            # 16 lanes at a time: the bits of K.gelu_tanh_mul_f16 (_geglu.py)
            f = (_geglu.gelu_tanh_mul_f16 if gate.flags.c_contiguous and up.flags.c_contiguous
                 else K.gelu_tanh_mul_f16)
            return f(gate, up, gate, K.gelu_f16_table(), _par(gate.size))
        return K.gelu_tanh_mul(gate, up, gate, _par(gate.size))

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        # the 16-lane kernel reads C-contiguous rows: a strided gate is computed in a copy
        # and written back, so the result is still in gate (the ops' in-place contract)
        g = np.ascontiguousarray(gate)
        _swiglu.swiglu(g, np.ascontiguousarray(up), g, _par(g.size))
        if g is not gate:
            gate[...] = g
        return gate

    def swiglu_matmul(self, gate: np.ndarray, up: np.ndarray, w) -> np.ndarray:
        """matmul(swiglu(gate, up), w), the same bits (gate may be overwritten). Repacked
        weights take the SwiGLU straight into their activation codes (packed.py)."""
        if self.numerics == "ggml" and isinstance(w, PackedMatrix):
            out = packed_swiglu_matmul(gate.reshape(-1, gate.shape[-1]),
                                       up.reshape(-1, up.shape[-1]), w)
            return out.reshape(w.N) if gate.ndim == 1 else out
        return self.matmul(self.swiglu(gate, up), w)

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x += y
        return x

    def scale(self, x: np.ndarray, s: float) -> np.ndarray:
        x *= np.float32(s)
        return x

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if rows.shape[0] == x.shape[0]:
            return x
        return np.ascontiguousarray(x[rows])

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    # -- encoder models (BERT) ---------------------------------------------------------------
    def layer_norm(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
        from edgeinfer.backends.cpu.encoder import layer_norm
        flat = x.reshape(-1, x.shape[-1])
        return layer_norm(flat, w, b, eps, np.empty_like(flat), _par(flat.size)).reshape(x.shape)

    def contiguous(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x)

    def gelu(self, x: np.ndarray) -> np.ndarray:
        """GELU (tanh approximation) in place; ggml numerics through its f16 table."""
        ones = np.ones_like(x)
        if self.numerics == "ggml":
            return K.gelu_tanh_mul_f16(x, ones, x, K.gelu_f16_table(), _par(x.size))
        return K.gelu_tanh_mul(x, ones, x, _par(x.size))

    def encoder_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          batch: ForwardBatch, scale: float, window: int = 0) -> np.ndarray:
        """Every token attends to every token of its own sequence in this batch (within
        window // 2 positions either side when window > 0: EmbeddingGemma's local layers)."""
        from edgeinfer.backends.cpu.encoder import encoder_attention, sequence_bounds
        bounds = batch.cache.get("seq_bounds")
        if bounds is None:      # once per step, not per layer
            bounds = batch.cache["seq_bounds"] = sequence_bounds(batch.token_seq)
        T, H, D = q.shape
        return encoder_attention(q, k, v, bounds[0], bounds[1], batch.positions,
                                 int(window) // 2, np.float32(scale), np.empty_like(q),
                                 _par(T * H * D * 8))

    # -- paged KV cache --------------------------------------------------------------------
    def new_kv_cache(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int,
                     head_dim: int, layer_blocks=None) -> CpuKVCache:
        """layer_blocks: blocks per layer (a sliding-window group's smaller pool)."""
        blocks = list(layer_blocks) if layer_blocks is not None else [num_blocks] * n_layers
        row = (block_size, n_kv_head, K.kv_row_width(self.kv_cache_type, head_dim))
        dtype = K.kv_dtype(self.kv_cache_type)
        arrays = _zeroed_pages([(b, *row) for b in blocks] * 2, dtype)
        return CpuKVCache(arrays[:len(blocks)], arrays[len(blocks):], block_size)

    def attention(self, q, k, v, cache: CpuKVCache, layer: int, batch: ForwardBatch,
                  scale: float, window: int, sinks: np.ndarray | None = None) -> np.ndarray:
        """Write this step's K/V into the cache, then attend through the block tables.
        sinks: float32[H] attention-sink logits (gpt-oss), None for none."""
        rotated = self.kv_cache_type == "q8_0" and q.shape[-1] % _rot.ROT == 0
        if rotated:     # llama.cpp's rotation around a quantized cache (_rotate.py)
            par = _par(q.size + k.size + v.size)
            q, k, v = _rot.rotate(q, par), _rot.rotate(k, par), _rot.rotate(v, par)
        K.kv_write(cache.k[layer], cache.v[layer], k, v, batch.slots_for(layer))
        out = np.empty_like(q)
        T, H, D = q.shape
        longest = batch.cache.get("longest")
        if longest is None:     # once per step, not per layer
            longest = batch.cache["longest"] = int(batch.positions.max()) + 1 if T else 0
        keys = min(longest, window) if window > 0 else longest
        par = _par(T * H * keys * D // 16)
        ggml_rounding = self.numerics == "ggml"
        if ggml_rounding and self.kv_cache_type == "q8_0":
            # llama.cpp's flash attention over a q8_0 K cache: Q in q8_0 blocks (K's dot
            # type), softmax weights and V summed in f32 (nothing rounded to f16)
            q2 = q.reshape(T * H, D)
            q = K.act_round_q8_0(q2, np.empty_like(q2)).reshape(T, H, D)
            ggml_rounding = False
        out = A.paged_attention(q, cache.k[layer], cache.v[layer], batch.tables_for(layer),
                                batch.token_seq, batch.positions, window, np.float32(scale),
                                ggml_rounding, out, par, None, sinks=sinks, keys=keys)
        if batch.attn_until is not None:       # image rows see their whole image
            from edgeinfer.backends.cpu.image_attention import image_rows
            image_rows(q, cache.k[layer], cache.v[layer], batch.tables_for(layer),
                       cache.block_size, batch.token_seq, batch.positions, batch.attn_until,
                       window, scale, out)
        return _rot.rotate(out, _par(out.size)) if rotated else out

    def put_rows(self, x: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """x[rows] = values (image embeddings in place of token embeddings), in place."""
        x[rows] = values
        return x
