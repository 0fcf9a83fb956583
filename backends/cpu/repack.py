"""Repacking GGUF quantized weights for the integer-dot kernels (see _int8.py).

Every supported block format is, exactly, `w = s * (code - zero_point) + o` per small block of
B = 32 (legacy quants, Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K) columns, with an unsigned code of
at most 8 bits, a scale s and, for the formats with minimums, an offset o. The repacked matrix
keeps those codes in 16-row tiles, so one VNNI instruction handles four columns of sixteen
rows, with the bits the format has: two 4-bit codes a byte (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K),
that plus a bit plane of fifth bits (Q5_0, Q5_1, Q5_K), that plus the high two bits of four
codes a byte (Q6_K), a byte (Q8_0). Scales that are IEEE halves in the GGUF (the legacy
formats) stay halves; the k-quants keep an int8 per block times a half per super-block. So
decode reads about the bytes the GGUF holds (cpu_plan.packed_nbytes): the same for Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1, 4.56 bits a weight for Q4_K (4.5 in the GGUF), 6.56 for Q6_K (6.56).
Decoding a repacked row (`rows`) is bit-exact with gguf.quants.dequantize.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from edgeinfer.backends import cpu_plan
from edgeinfer.backends.cpu_plan import REPACKABLE, packed_nbytes  # noqa: F401 (re-exported)
from edgeinfer.formats.ggml_types import GGMLQuantizationType as Q

from . import _int8
from .quants import QuantMatrix

LANES = _int8.LANES

# the layout's tables and sizes, shared with the daemon's numba-free answer (cpu_plan.py)
_ACT_BLOCK, _COLS, _WITH_OFFSET, _BITS, _SUB = (cpu_plan.ACT_BLOCK, cpu_plan.COLS,
                                                cpu_plan.WITH_OFFSET, cpu_plan.BITS, cpu_plan.SUB)
# legacy block formats: (offset of qs, offset of qh or -1, has a minimum, zero point)
_LEGACY = {int(Q.Q4_0): (2, -1, False, 8), int(Q.Q4_1): (4, -1, True, 0),
           int(Q.Q5_0): (6, 2, False, 16), int(Q.Q5_1): (8, 4, True, 0)}


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-value block -> 32 codes: low nibbles, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """bit i of the little-endian uint32 qh, for i < n, as uint8 [.., n]. unpackbits works
    on the bytes in place: 25x faster than shifting a uint32 [.., n] array (Q5_0 repacking
    was a third of a Qwen2.5 0.5B cold start)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, count=n, bitorder="little")


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block (12 packed bytes)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def unpack(w: QuantMatrix):
    """(codes uint8[N, K], s float32[N, K/B], o float32[N, K/B] or None, zero_point), with
    B = _COLS[type] columns per scale."""
    codes, zp, d, sc, dm, mn = unpack_parts(w)
    if sc is None:
        return codes, d, dm, zp
    N, nsb = d.shape
    s = (d[:, :, None] * sc.reshape(N, nsb, -1)).reshape(N, -1)
    o = None if dm is None else (-(dm[:, :, None] * mn.reshape(N, nsb, -1))).reshape(N, -1)
    return codes, s, o, zp


def unpack_parts(w: QuantMatrix):
    """(codes uint8[N, K], zero_point, d, sc, dm, mn). Legacy formats: d = s float32[N, K/B]
    and dm = o (or None), halves, sc = mn = None. K-quants: d, dm float32[N, K/256] halves, sc,
    mn float32[N, K/B] small integers (dm, mn None without minimums): s = d * sc and
    o = -(dm * mn)."""
    code = int(w.qtype)
    N, K = w.N, w.K
    blk = w.blocks.reshape(-1, w.blocks.shape[2])        # one GGUF block per row
    n = blk.shape[0]
    if code == Q.Q8_0:
        d = _f16(blk[:, 0:2])
        codes = blk[:, 2:34] ^ np.uint8(0x80)          # int8 q -> q + 128, one pass
        return codes.reshape(N, K), 128, d.reshape(N, -1), None, None, None
    if code == Q.Q4_0:
        return _nibbles(blk[:, 2:18]).reshape(N, K), 8, _f16(blk[:, 0:2]).reshape(N, -1), None, None, None
    if code == Q.Q4_1:
        return (_nibbles(blk[:, 4:20]).reshape(N, K), 0, _f16(blk[:, 0:2]).reshape(N, -1), None,
                _f16(blk[:, 2:4]).reshape(N, -1), None)
    if code in (Q.Q5_0, Q.Q5_1):
        off = 2 if code == Q.Q5_0 else 4
        codes = _nibbles(blk[:, off + 4:off + 20]) | (_high_bits(blk[:, off:off + 4], 32) << 4)
        o = None if code == Q.Q5_0 else _f16(blk[:, 2:4]).reshape(N, -1)
        return codes.reshape(N, K), (16 if o is None else 0), _f16(blk[:, 0:2]).reshape(N, -1), None, o, None
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
        return (codes.reshape(N, K), 0, d.reshape(N, -1), sc.reshape(N, -1),
                dmin.reshape(N, -1), mn.reshape(N, -1))
    if code == Q.Q6_K:
        ql, qh = blk[:, 0:128], blk[:, 128:192]
        sc = blk[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])
        ql = ql.reshape(n, 2, 2, 32)          # [half][low 32 bytes, high 32 bytes]
        qh = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        low = np.concatenate([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F,
                              ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2).reshape(n, 2, 4, 32)
        codes = (low | ((qh & 3) << 4)).reshape(n, 256)
        return codes.reshape(N, K), 32, d.reshape(N, -1), sc.reshape(N, -1), None, None
    if code == Q.Q2_K:
        sc, qs = blk[:, 0:16], blk[:, 16:80]
        d, dmin = _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
        codes = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        return (codes.reshape(N, K), 0, d.reshape(N, -1), (sc & 0x0F).astype(np.float32).reshape(N, -1),
                dmin.reshape(N, -1), (sc >> 4).astype(np.float32).reshape(N, -1))
    if code == Q.Q3_K:
        hmask, qs, scb = blk[:, 0:32], blk[:, 32:96], blk[:, 96:108]
        d = _f16(blk[:, 108:110])
        lo = (scb[:, 0:8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1).reshape(n, 16)
        hi = (scb[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 2, 1).reshape(n, 16)
        scales = ((lo & 0x0F) | ((hi & 3) << 4)).astype(np.float32) - 32.0
        low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = low.reshape(n, 8, 32) | (high << 2)        # q + 4, in 0..7
        return codes.reshape(N, K), 4, d.reshape(N, -1), scales.reshape(N, -1), None, None
    raise ValueError(f"{w.qtype.name} cannot be repacked")


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """A weight of N rows of K values, repacked for `_int8.int8_matmul` (see module doc)."""
    q: np.ndarray            # uint8[T, nb, code_planes(B, bits), 16, 4]: the codes
    h: np.ndarray            # uint8[T, nb, B/4, 8]: fifth bits (5-bit formats; else a dummy)
    s: np.ndarray            # [T, nb, 16] scales: uint16 halves, or int8 (k-quants, times d)
    o: np.ndarray            # as s: offsets (minimums for k-quants); s itself without them
    d: np.ndarray            # uint16[T, K/256, 16] k-quant super-block scales (else a dummy)
    dm: np.ndarray           # as d, for the minimums (d itself without them)
    has_o: bool
    zero_point: int
    B: int                   # columns per scale
    A: int                   # columns per activation scale (32: Q8_0, 256: Q8_K)
    qtype: Q
    K: int
    N: int
    bits: int                # code bits: 4, 5, 6 or 8
    fmt: int                 # _int8.fmt_code(B, bits, has_o, k-quant scales)

    @property
    def sub(self) -> bool:
        return self.s.dtype == np.int8

    @functools.cached_property
    def W(self) -> np.ndarray:
        """The addresses and sizes the tile kernels take (_int8.weight_fields), made once."""
        return _int8.weight_fields(self.q, self.h, self.s, self.o, self.d, self.dm)

    @property
    def nbytes(self) -> int:
        n = self.q.nbytes + (self.h.nbytes if self.bits == 5 else 0) + self.s.nbytes
        if self.sub:
            n += self.d.nbytes + (self.dm.nbytes if self.has_o else 0)
        return n + (self.o.nbytes if self.has_o else 0)

    @classmethod
    def from_quant(cls, w: QuantMatrix) -> "PackedMatrix":
        code = int(w.qtype)
        N, K, B, bits = w.N, w.K, _COLS[code], _BITS[code]
        sub = code in _SUB
        T = -(-N // LANES)
        pad = T * LANES - N
        nb = K // B
        q = np.zeros((T, nb, _int8.code_planes(B, bits), LANES, 4), np.uint8)
        h = np.zeros((T, nb, B // 4, 8) if bits == 5 else (1, 1, 1, 8), np.uint8)
        dummy = np.zeros((1, 1, LANES), np.uint16)

        def tiles(a, dtype):      # [T*16, n] -> [T, n, 16]: halves (exact: they were), int8
            if pad:   # zero rows (scales 0) fill the last tile; their outputs are never written
                a = np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)])
            a = a.reshape(T, LANES, -1).transpose(0, 2, 1)
            a = a.astype(np.float16).view(np.uint16) if dtype == np.uint16 else a.astype(dtype)
            return np.ascontiguousarray(a)

        if w.qtype == Q.Q8_0 and not pad:
            # the common output-head format: straight from the GGUF bytes in one pass
            zp, s, o, d, dm = 128, np.empty((T, nb, LANES), np.uint16), None, dummy, dummy
            _int8.tile_q8_0(w.blocks, q, s)
        elif code in _LEGACY and not pad:
            # Q4_0/Q4_1/Q5_0/Q5_1 straight from the GGUF bytes too (most of Qwen2.5's matrices
            # are Q5_0: unpacking them to codes first was 1.5 of a 4.5 s cold start)
            qs_off, qh_off, with_min, zp = _LEGACY[code]
            s = np.empty((T, nb, LANES), np.uint16)
            o = np.empty((T, nb, LANES), np.uint16) if with_min else None
            _int8.tile_legacy(w.blocks, qs_off, qh_off, with_min, q, h, s, s if o is None else o)
            d = dm = dummy
        elif code in (Q.Q4_K, Q.Q6_K) and not pad:
            # the k-quants of Q4_K_M files, straight from the bytes too: unpacking them with
            # numpy first was 0.3 of Qwen2.5-Coder 0.5B's 0.43 s of repacking
            zp = 0 if code == Q.Q4_K else 32
            s = np.empty((T, nb, LANES), np.int8)
            d = np.empty((T, K // 256, LANES), np.uint16)
            if code == Q.Q4_K:
                o, dm = np.empty((T, nb, LANES), np.int8), np.empty_like(d)
                _int8.tile_q4_k(w.blocks, q, s, o, d, dm)
            else:
                o, dm = None, d
                _int8.tile_q6_k(w.blocks, q, s, d)
        else:
            codes, zp, d, sc, dm, mn = unpack_parts(w)
            if pad:
                codes = np.concatenate([codes, np.full((pad, K), zp, np.uint8)])
            _int8.tile_codes(np.ascontiguousarray(codes), bits, q, h)
            if sub:
                s, d = tiles(sc, np.int8), tiles(d, np.uint16)
                o, dm = (tiles(mn, np.int8), tiles(dm, np.uint16)) if dm is not None else (None, d)
            else:
                s, o, d = tiles(d, np.uint16), (tiles(dm, np.uint16) if dm is not None else None), dummy
                dm = d
        has_o = o is not None
        return cls(q, h, s, o if has_o else s, d, dm, has_o, zp, B, _ACT_BLOCK[code], Q(code),
                   K, N, bits, _int8.fmt_code(B, bits, has_o, sub))

    def _scales(self, a: np.ndarray, d: np.ndarray, t: np.ndarray, lane: np.ndarray) -> np.ndarray:
        """float32[n, nb] of one row per (t, lane): the same float32 products the kernel forms."""
        if not self.sub:
            return a[t, :, lane].view(np.float16).astype(np.float32)
        per = 256 // self.B
        dd = d[t, :, lane].view(np.float16).astype(np.float32)          # [n, K/256]
        return (dd[:, :, None] * a[t, :, lane].astype(np.float32).reshape(t.size, -1, per)
                ).reshape(t.size, -1)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32[len(ids), K]: decoded rows (embedding lookup), bit-exact with gguf's."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.N):
            raise IndexError(f"row id out of range [0, {self.N})")
        t, lane = ids // LANES, ids % LANES
        nb = self.K // self.B
        codes = self.q[t, :, :, lane, :]                       # [n, nb, planes, 4]
        if self.bits != 8:
            nq = self.B // 4
            nib = codes[:, :, :nq // 2]
            quads = np.concatenate([nib & 0x0F, nib >> 4], axis=2)          # [n, nb, nq, 4]
            if self.bits == 5:
                plane = self.h[t, :, :, lane // 2]             # [n, nb, nq]: byte (4 lane + k) / 8
                shift = ((lane % 2) * 4)[:, None, None, None] + np.arange(4, dtype=np.int64)
                quads = quads | (((plane[..., None] >> shift) & 1) << 4).astype(np.uint8)
            elif self.bits == 6:
                high = codes[:, :, nq // 2:]                   # [n, nb, nq / 4, 4]
                sh = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None, None]
                two = (high[:, :, None] >> sh) & 3             # [n, nb, 4 (j % 4), nq / 4, 4]
                two = two.transpose(0, 1, 3, 2, 4).reshape(quads.shape)     # quad j = 4 (j // 4) + j % 4
                quads = quads | (two << 4)
            codes = quads
        vals = codes.reshape(ids.size, nb, self.B).astype(np.int32) - self.zero_point
        s = self._scales(self.s, self.d, t, lane)[:, :, None]
        out = s * vals.astype(np.float32)
        if self.has_o:
            o = self._scales(self.o, self.dm, t, lane)
            out = out + (-o if self.sub else o)[:, :, None]
        return out.reshape(ids.size, self.K).astype(np.float32)
