"""A mixture-of-experts layer's weights on the CPU: the router and the 3-D expert tensors.

llama.cpp stores a layer's experts as 3-D tensors, `ffn_{gate,up}_exps` [E, F, X] and
`ffn_down_exps` [F, X, E] in ggml order: expert e is rows e*N .. (e+1)*N - 1 of one matrix of
E*N rows. Two ways to hold them:

- grouped (repacked weights of a repackable type, N a multiple of 16): each tensor repacked
  once into one int8-tile array (repack.py) whose tiles e*N/16 .. (e+1)*N/16 - 1 are expert
  e's, and the whole FFN of a step (gate+up, SwiGLU, down, the weighted sum) runs as one
  kernel call over the chosen experts' tiles only (_moe.py). Copies the weights, as repacking
  does for every matrix (repack.packed_nbytes; counted by CpuOps.weights_nbytes).
- per expert (weights left in the GGUF map, or a type the tiles do not take): each expert a
  2-D matrix over its slice of the file's bytes (nothing copied), run one expert at a time.

Both give every (token, expert) row the same bits (the tile kernels compute a row alike for
any row count), and the router's logits are the one-row product's bits for every row, so a
token's FFN output does not depend on the tokens beside it.
"""
from __future__ import annotations

import dataclasses
import threading

import numba
import numpy as np

from edgeinfer.formats.ggml_types import GGMLQuantizationType

from . import _int8, _moe, _router
from .matmul import QuantMatrix, matmul
from .packed import SERIAL_MACS, SERIAL_QUANT
from .repack import REPACKABLE, PackedMatrix

_MATS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class ExpertSlices:
    """A GGUF file seen through one 3-D expert tensor: `name[e]` is expert e's 2-D matrix,
    a view of its bytes, so ops.matrix() takes it like a real tensor."""

    def __init__(self, gf, name: str):
        t = gf.tensors[name]
        K, N, X = (int(d) for d in t.shape)
        self.gf, self.base, self.per = gf, name, t.nbytes // X
        self.path, self.metadata = gf.path, gf.metadata
        self.tensors = {f"{name}[{e}]": dataclasses.replace(
            t, name=f"{name}[{e}]", shape=(K, N), offset=t.offset + e * self.per,
            nbytes=self.per) for e in range(X)}
        self.names = list(self.tensors)

    def raw(self, name: str) -> np.ndarray:
        e = self.names.index(name)
        return self.gf.raw(self.base)[e * self.per:(e + 1) * self.per]

    def release_pages(self, name: str | None = None) -> None:
        if name is None or name == self.names[-1]:      # after the last expert's copy
            self.gf.release_pages(self.base)


def groupable(gf, prefix: str) -> bool:
    """Whether the layer's expert tensors can be held grouped (see the module doc)."""
    for m in _MATS:
        t = gf.tensors[prefix + m + ".weight"]
        if int(t.ggml_type) not in REPACKABLE or int(t.shape[1]) % _int8.LANES:
            return False
    return True


def _expert_fields(p: PackedMatrix, E: int) -> np.ndarray:
    """W (see _int8.weight_fields) of each expert of a repacked E*N-row matrix: the arrays'
    addresses offset to the expert's first tile (arrays with one dummy tile: not offset)."""
    T = p.q.shape[0]
    arrays = (p.q, p.h, p.s, p.o, p.d, p.dm)
    base = np.array([a.ctypes.data for a in arrays], np.int64)
    step = np.array([a.nbytes // E if a.shape[0] == T else 0 for a in arrays], np.int64)
    W = np.empty((E, _int8.W_FIELDS), np.int64)
    W[:, :6] = base + np.arange(E, dtype=np.int64)[:, None] * step
    W[:, 6:] = [T // E, p.q.shape[1], p.q.shape[2], p.d.shape[1]]
    return W


class Workspace(threading.local):
    """Scratch for _moe.moe_ffn, shared by a model's layers and kept between steps (a
    prefill's 20 MB made fresh each call cost thousands of page faults); one per thread."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)


class GroupedExperts:
    """The expert tensors repacked, one tile array each, run by _moe.moe_ffn."""

    def __init__(self, mats: list, E: int, isa: int, work: "Workspace"):
        """mats: gate, up, down, each the E experts' matrices repacked as one of E*N rows."""
        self.work = work
        self.gate, self.up, self.down = mats
        self.E, self.F, self.X = E, mats[0].N // E, mats[2].N // E
        self.Wt = np.stack([_expert_fields(p, E) for p in mats])
        self.P = np.array([[_int8.kernel_address(p.fmt, isa), p.A, p.B, p.zero_point, p.K,
                            p.N // E, p.q.shape[0] // E, p.q.shape[1] * p.q.shape[2] * 64]
                           for p in mats], np.int64)
        # tiles read per matrix and expert since the load (tests: only the chosen experts)
        self.tiles_read = np.zeros((3, E), np.int64)

    @classmethod
    def from_gguf(cls, gf, prefix: str, isa: int, work: "Workspace") -> "GroupedExperts":
        mats = []
        for m in _MATS:
            name = prefix + m + ".weight"
            t = gf.tensors[name]
            K, N, E = (int(d) for d in t.shape)
            mats.append(PackedMatrix.from_quant(
                QuantMatrix.from_bytes(gf.raw(name), t.ggml_type, K, N * E)))
            gf.release_pages(name)        # keeps peak RSS near one copy of the weights
        return cls(mats, E, isa, work)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def __call__(self, h: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 router: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
        """The FFN of rows h routed to ids with weights; with router (float32[E, X]), ids
        and weights are first filled by routing h (_router's, in the same kernel call).
        threads: numba's thread count by default (fused.py passes its step's)."""
        x = np.ascontiguousarray(h.reshape(-1, self.X), dtype=np.float32)
        T, k = ids.shape
        out = np.empty((T, self.X), np.float32)
        if threads is None:
            threads = numba.get_num_threads()
        nw = 1 if T * k * self.X * self.F < SERIAL_MACS else threads
        par = threads > 1 and T * self.X >= SERIAL_QUANT
        route = router is not None
        rw = router if route else _NO_ROUTER
        args = (x, rw, route, ids, weights, self.Wt, self.P, out, nw, par, self.tiles_read)
        need = _moe.moe_ffn(*args, np.zeros(2, np.int64), self.work.buf)
        if need:
            self.work.buf = np.empty(need + (need >> 2), np.uint8)     # with room to grow
            _moe.moe_ffn(*args, np.zeros(2, np.int64), self.work.buf)
        return out


# the router argument when ids and weights are given (read-only, as a mapped router is)
_NO_ROUTER = np.zeros((0, 0), np.float32)
_NO_ROUTER.setflags(write=False)


class ExpertBank:
    """A layer's router and experts: `grouped` (a GroupedExperts, run by CpuOps.moe_ffn) or,
    when None, `gate`, `up`, `down`: one matrix per expert (ops.matrix of its slice)."""

    def __init__(self, ops, gf, prefix: str, grouped: bool, isa: int, work: Workspace):
        # the router stays in the map (F32 in llama.cpp's files), one row per expert
        self.router = QuantMatrix.from_gguf(gf, prefix + "ffn_gate_inp.weight")
        self.router_f32 = (self.router.data.view(np.float32)
                           if self.router.qtype == GGMLQuantizationType.F32 else None)
        self.grouped = GroupedExperts.from_gguf(gf, prefix, isa, work) if grouped else None
        self.gate = self.up = self.down = None
        if not grouped:
            def experts(m: str) -> list:
                view = ExpertSlices(gf, prefix + m + ".weight")
                return [ops.matrix(view, name) for name in view.names]
            self.gate, self.up, self.down = (experts(m) for m in _MATS)

    def route(self, h: np.ndarray, k: int, rounder) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids int64[T, k], weights float32[T, k]): softmax over the router logits,
        the top k, renormalized (_router.py); every row the bits it gets alone, whatever T.
        rounder: the activation rounding of the router's type (ggml numerics), or None."""
        x = np.ascontiguousarray(h.reshape(-1, h.shape[-1]), dtype=np.float32)
        T, E = x.shape[0], self.router.N
        ids, wts = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        logits = np.empty((T, E), np.float32)
        if self.router_f32 is not None:
            threads = numba.get_num_threads()
            big = T * E * x.shape[1] >= SERIAL_MACS
            _router.route(x, self.router_f32, k, logits, ids, wts, threads if big else 1,
                          threads > 1 and big)
            return ids, wts
        if rounder is not None:
            x = rounder(x, np.empty_like(x))
        _router.route_logits(matmul(x, self.router, per_row=True), k, ids, wts)
        return ids, wts

    def logits(self, h: np.ndarray) -> np.ndarray:
        """float32[T, E]: the F32 router's logits, each row the bits it gets alone (route()'s
        kernel), for a model that routes them its own way (models/moe.py: softmax without
        renormalizing, sigmoid gating) and hands the choice to CpuOps.moe_ffn."""
        if self.router_f32 is None:
            raise ValueError("logits() reads an F32 router; this one is "
                             f"{GGMLQuantizationType(int(self.router.qtype)).name}")
        x = np.ascontiguousarray(h.reshape(-1, h.shape[-1]), dtype=np.float32)
        T, E = x.shape[0], self.router.N
        logits = np.empty((T, E), np.float32)
        threads = numba.get_num_threads()
        big = T * E * x.shape[1] >= SERIAL_MACS
        # the top-1 choice the kernel makes as well is scratch here
        _router.route(x, self.router_f32, 1, logits, np.empty((T, 1), np.int64),
                      np.empty((T, 1), np.float32), threads if big else 1, threads > 1 and big)
        return logits

    def run(self, h: np.ndarray, k: int, rounder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(FFN output, ids, weights) of a grouped bank: routing and experts in one kernel
        call when the router is F32 (llama.cpp's files), else route() then the experts."""
        T = h.reshape(-1, h.shape[-1]).shape[0]
        if self.router_f32 is None:
            ids, wts = self.route(h, k, rounder)
            return self.grouped(h, ids, wts), ids, wts
        ids, wts = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        return self.grouped(h, ids, wts, self.router_f32), ids, wts
