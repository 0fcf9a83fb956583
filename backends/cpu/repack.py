"""Repacking GGUF quantized weights for the integer-dot kernels (see _int8.py).

Every supported block format is, exactly, `w = s * (code - zero_point) + o` per small block of
B = 32 (legacy quants, Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K) columns, with an unsigned code of
at most 8 bits, a float32 scale s and, for the formats with minimums, a float32 offset o. The
repacked matrix keeps those codes one per byte in 16-row tiles, so one VNNI instruction handles
four columns of sixteen rows. Costs memory for the sub-8-bit formats (a Q4_K weight goes from
4.5 to 10 bits), which is why `CpuOps` repacks only while the model stays within a budget.
Decoding a repacked row (`rows`) is bit-exact with gguf.quants.dequantize.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from . import _int8
from .quants import QuantMatrix

LANES = _int8.LANES

# activation format (ggml's vec_dot_type) per weight type: block size of its scale
_ACT_BLOCK = {**{int(t): 32 for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)},
              **{int(t): 256 for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)}}
REPACKABLE = frozenset(_ACT_BLOCK)
# columns per repacked scale, and the formats whose blocks carry an offset (a minimum)
_COLS = {int(t): (16 if t in (Q.Q2_K, Q.Q3_K, Q.Q6_K) else 32) for t in map(Q, REPACKABLE)}
_WITH_OFFSET = frozenset(int(t) for t in (Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K))


def packed_nbytes(qtype, K: int, N: int) -> int:
    """Bytes a K x N matrix of this type takes repacked (codes, scales, offsets, padded rows)."""
    code = int(qtype)
    scales = 2 if code in _WITH_OFFSET else 1
    return -(-N // LANES) * LANES * (K + K // _COLS[code] * 4 * scales)


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-value block -> 32 codes: low nibbles, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """bit i of the little-endian uint32 qh, for i < n, as uint8 [.., n]."""
    h = np.ascontiguousarray(qh).view(np.uint32)
    return ((h >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block (12 packed bytes)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def unpack(w: QuantMatrix):
    """(codes uint8[N, K], s float32[N, K/B], o float32[N, K/B] or None, zero_point), with
    B = _COLS[type] columns per scale."""
    code = int(w.qtype)
    N, K = w.N, w.K
    blk = w.blocks.reshape(-1, w.blocks.shape[2])        # one GGUF block per row
    n = blk.shape[0]
    if code == Q.Q8_0:
        d = _f16(blk[:, 0:2])
        codes = blk[:, 2:34] ^ np.uint8(0x80)          # int8 q -> q + 128, one pass
        return codes.reshape(N, K), d.reshape(N, -1), None, 128
    if code == Q.Q4_0:
        return _nibbles(blk[:, 2:18]).reshape(N, K), _f16(blk[:, 0:2]).reshape(N, -1), None, 8
    if code == Q.Q4_1:
        return (_nibbles(blk[:, 4:20]).reshape(N, K), _f16(blk[:, 0:2]).reshape(N, -1),
                _f16(blk[:, 2:4]).reshape(N, -1), 0)
    if code in (Q.Q5_0, Q.Q5_1):
        off = 2 if code == Q.Q5_0 else 4
        codes = _nibbles(blk[:, off + 4:off + 20]) | (_high_bits(blk[:, off:off + 4], 32) << 4)
        o = None if code == Q.Q5_0 else _f16(blk[:, 2:4]).reshape(N, -1)
        return codes.reshape(N, K), _f16(blk[:, 0:2]).reshape(N, -1), o, (16 if o is None else 0)
    if code in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc, mn = _scale_min_k4(blk[:, 4:16])
        if code == Q.Q4_K:
            qs = blk[:, 16:144].reshape(n, 4, 32)
            codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
        else:
            qh = blk[:, 16:48]
            qs = blk[:, 48:176].reshape(n, 4, 32)
            low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = (low | (high << 4)).reshape(n, 256)
        s = d * sc
        o = -(dmin * mn)
        return codes.reshape(N, K), s.reshape(N, -1), o.reshape(N, -1), 0
    if code == Q.Q6_K:
        ql, qh = blk[:, 0:128], blk[:, 128:192]
        sc = blk[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])
        ql = ql.reshape(n, 2, 2, 32)          # [half][low 32 bytes, high 32 bytes]
        qh = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        low = np.concatenate([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F,
                              ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2).reshape(n, 2, 4, 32)
        codes = (low | ((qh & 3) << 4)).reshape(n, 256)
        return codes.reshape(N, K), (d * sc).reshape(N, -1), None, 32
    if code == Q.Q2_K:
        sc, qs = blk[:, 0:16], blk[:, 16:80]
        d, dmin = _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
        codes = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        s = d * (sc & 0x0F).astype(np.float32)
        o = -(dmin * (sc >> 4).astype(np.float32))
        return codes.reshape(N, K), s.reshape(N, -1), o.reshape(N, -1), 0
    if code == Q.Q3_K:
        hmask, qs, scb = blk[:, 0:32], blk[:, 32:96], blk[:, 96:108]
        d = _f16(blk[:, 108:110])
        lo = (scb[:, 0:8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1).reshape(n, 16)
        hi = (scb[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 2, 1).reshape(n, 16)
        scales = ((lo & 0x0F) | ((hi & 3) << 4)).astype(np.float32) - 32.0
        low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = low.reshape(n, 8, 32) | (high << 2)        # q + 4, in 0..7
        return codes.reshape(N, K), (d * scales).reshape(N, -1), None, 4
    raise ValueError(f"{w.qtype.name} cannot be repacked")


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """A weight of N rows of K values, repacked for `_int8.int8_matmul` (see module doc)."""
    q: np.ndarray            # uint8[T, nb, B/4, 16, 4]
    s: np.ndarray            # float32[T, nb, 16]
    o: np.ndarray            # float32[T, nb, 16] (s itself when the format has no offset)
    has_o: bool
    zero_point: int
    B: int                   # columns per scale
    A: int                   # columns per activation scale (32: Q8_0, 256: Q8_K)
    qtype: Q
    K: int
    N: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes + (self.o.nbytes if self.has_o else 0)

    @classmethod
    def from_quant(cls, w: QuantMatrix) -> "PackedMatrix":
        N, K, B = w.N, w.K, _COLS[int(w.qtype)]
        T = -(-N // LANES)
        pad = T * LANES - N
        if w.qtype == Q.Q8_0 and not pad:
            # the common output-head format: straight from the GGUF bytes in one pass
            blocks = w.blocks
            nb, zp, o = K // B, 128, None
            s = _f16(blocks[:, :, 0:2]).reshape(N, nb)
            q = np.empty((T, nb, B // 4, LANES, 4), np.uint8)
            _int8.tile_q8_0(blocks, q)
        else:
            codes, s, o, zp = unpack(w)
            if pad:    # zero rows (s = o = 0) fill the last tile; their outputs are never written
                codes = np.concatenate([codes, np.full((pad, K), zp, np.uint8)])
                s = np.concatenate([s, np.zeros((pad, s.shape[1]), np.float32)])
                if o is not None:
                    o = np.concatenate([o, np.zeros((pad, o.shape[1]), np.float32)])
            nb = K // B
            q = np.empty((T, nb, B // 4, LANES, 4), np.uint8)
            _int8.tile_codes(np.ascontiguousarray(codes), q)

        def tiles(a):      # [T*16, nb] -> [T, nb, 16]
            return np.ascontiguousarray(a.astype(np.float32).reshape(T, LANES, nb).transpose(0, 2, 1))

        st = tiles(s)
        return cls(q, st, tiles(o) if o is not None else st, o is not None, zp, B,
                   _ACT_BLOCK[int(w.qtype)], Q(int(w.qtype)), K, N)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32[len(ids), K]: decoded rows (embedding lookup), bit-exact with gguf's."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.N):
            raise IndexError(f"row id out of range [0, {self.N})")
        t, lane = ids // LANES, ids % LANES
        codes = self.q[t, :, :, lane, :].reshape(ids.size, self.K // self.B, self.B)
        vals = codes.astype(np.int32) - self.zero_point
        s = self.s[t, :, lane][:, :, None]
        out = s * vals.astype(np.float32)
        if self.has_o:
            out = out + self.o[t, :, lane][:, :, None]
        return out.reshape(ids.size, self.K).astype(np.float32)
