"""Bidirectional attention inside an image (Gemma 3), for the rows the paged kernel computed
causally.

The paged kernel gives every row the keys [pos - window + 1, pos]. A row of an image must see
[pos - window + 1, until] where `until` is the image's last position (ForwardBatch.attn_until;
llama.cpp decodes an image batch non-causally: the sliding window still bounds the past, not
the rest of the image). Those rows are few (an image's tokens, once per prompt), so they are
recomputed here in numpy, one group per (sequence, until), and written over the kernel's
output. K/V are read back from the pool (f16 bits, q8_0 blocks or float32).
"""
from __future__ import annotations

import numpy as np


def _rows_f32(pool: np.ndarray, blocks: np.ndarray, slots: np.ndarray, D: int) -> np.ndarray:
    """[N, KVH, D] float32 from pool[blocks, slots]."""
    raw = pool[blocks, slots]
    if pool.dtype == np.uint16:
        return raw.view(np.float16).astype(np.float32)
    if pool.dtype == np.uint8:            # q8_0 blocks: 2-byte f16 scale + 32 int8 each
        n, kvh, row = raw.shape
        b = raw.reshape(n, kvh, row // 34, 34)
        d = b[..., :2].copy().view(np.float16).astype(np.float32)     # [n, kvh, nb, 1]
        q = b[..., 2:].view(np.int8).astype(np.float32)
        return (q * d).reshape(n, kvh, D)
    return np.asarray(raw, np.float32)


def image_rows(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray,
               block_size: int, token_seq: np.ndarray, positions: np.ndarray,
               attn_until: np.ndarray, window: int, scale: float, out: np.ndarray) -> None:
    """Overwrite out[t] for every t with attn_until[t] > positions[t]."""
    rows = np.nonzero(attn_until > positions)[0]
    if not len(rows):
        return
    T, H, D = q.shape
    KVH = k_pool.shape[2]
    group = H // KVH
    keys_of = {}
    for t in rows:
        keys_of.setdefault((int(token_seq[t]), int(attn_until[t])), []).append(int(t))
    for (s, until), ts in keys_of.items():
        ts = np.asarray(ts)
        pos = positions[ts].astype(np.int64)
        lo = np.maximum(pos - window + 1, 0) if window > 0 else np.zeros_like(pos)
        first = int(lo.min())
        kpos = np.arange(first, until + 1, dtype=np.int64)
        blocks = tables[s, kpos // block_size].astype(np.int64)
        slots = kpos % block_size
        K = _rows_f32(k_pool, blocks, slots, D)          # [N, KVH, D]
        V = _rows_f32(v_pool, blocks, slots, D)
        if group > 1:
            K, V = np.repeat(K, group, axis=1), np.repeat(V, group, axis=1)
        Q = q[ts].astype(np.float32)                     # [R, H, D]
        sc = np.einsum("rhd,nhd->hrn", Q, K) * np.float32(scale)
        sc[:, kpos[None, :] < lo[:, None]] = -np.inf
        sc -= sc.max(axis=2, keepdims=True)
        np.exp(sc, out=sc)
        sc /= sc.sum(axis=2, keepdims=True)
        out[ts] = np.einsum("hrn,nhd->rhd", sc, V).astype(out.dtype)
