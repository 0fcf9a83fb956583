"""Grouped expert matmuls of a mixture-of-experts FFN, one numba call per layer.

The (token, slot) pairs a router chose are sorted by expert (a counting sort, stable: within
an expert, pairs keep token-major order), so each chosen expert is one group of rows and its
weight tiles stream once for all of them: in decode only the chosen experts' tiles are read,
in a prefill every expert's tiles are read once for every token routed to it. Per layer:

1. x is quantized once for the gate/up activation format (and once more only if up's format
   differs), then each pair's codes are gathered into its group: qa rows [P, K], and da, bsf,
   zb in the [nb, n] layout the tile kernels take, one block per group (group g of n rows at
   p0 holds its [nb, n] at offset p0 * nb).
2. gate and up of every group in one parallel region: work items (group, matrix, tiles) dealt
   from a shared counter, each run by the format's tile kernel (_int8's cfuncs, by address).
3. SwiGLU per row (silu(g) * u: _swiglu.swiglu_row, as the ops), quantized for down's
   format into the group layout.
4. down of every group, one parallel region as 2.
5. out[t] = y[t, slot 0] * w0, then += y[t, slot j] * wj slot by slot (llama.cpp's order).

A row's codes and tile arithmetic are those of the per-expert path (packed_matmuls on the
expert's rows: activation quantization is per row, and the tile kernels give a row the same
bits for any row count), so every (token, expert) row gets the same bits grouped or not, and
a token gets the same output alone or in any batch.

A bank matrix is described by W tables int64[3, E, W_FIELDS] (the expert's tiles: _int8's W,
its addresses offset to the expert) and P int64[3, N_PARAMS] (see below).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _stamp
from ._actquant import _quantize_block_vec, block_zb
from ._int8 import _call_tiles, _fetch_add
from ._router import route_rows
from ._swiglu import swiglu_row

# inlined here (quantize_act_block's vector form and its deps, _int8's atomic counter): see
# _stamp.py. _int8's tile kernels are called by address, not compiled in.
_DEPS = ("_actquant.py", "kernels.py", "_simd.py", "_router.py", "_swiglu.py", "_int8.py")
_DEPS_HASH = "8ebc4281f3290049"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

# P[m] fields of matrix m (0 gate, 1 up, 2 down)
FN, ACT_BLOCK, W_BLOCK, ZP, K_COLS, N_ROWS, TILES, TILE_BYTES = range(8)
N_PARAMS = 8
# a chunk of one expert's tiles is at least this many bytes of codes when a group has fewer
# than 8 rows (decode: memory-bound, one long stream per thread; as _int8.SMALL_M_CHUNK_BYTES)
SMALL_M_CHUNK_BYTES = 1 << 17


@njit(inline="always", nogil=True)
def _quantize(x, A, B, zp, qa, da, bsf, zb, r):
    for ab in range(x.shape[1] // A):
        _quantize_block_vec(x, r, r, ab, A, B, zp, qa, da, bsf, zb)


@njit(inline="always", nogil=True)
def _gather(qa, da, bsf, zp, order, k, gstart, glen, grp, qa_g, da_g, bsf_g, zb_g, p):
    """Pair p of the sorted order: its token's codes and block entries into its group."""
    t = order[p] // k
    g = grp[p]
    n = glen[g]
    r = p - gstart[g]
    nb = da.shape[0]
    qa_g[p, :] = qa[t, :]
    base = gstart[g] * nb
    for b in range(nb):
        i = base + b * n + r
        da_g[i] = da[b, t]
        bsf_g[i] = bsf[b, t]
        zb_g[i] = block_zb(bsf[b, t], zp)   # exact: |sum| < 2^24


@njit(inline="always", nogil=True)
def _run_item(c, items, P, Wt, acts, outs, gstart, glen, gexp, stats):
    """Work item c: tiles items[c, 2] .. items[c, 3] of matrix items[c, 1] for group
    items[c, 0]; acts[m] = (qa, da, bsf, zb) addresses of its gathered activations."""
    g, m, t0, t1 = items[c, 0], items[c, 1], items[c, 2], items[c, 3]
    e = gexp[g]
    K, N = P[m, K_COLS], P[m, N_ROWS]
    nb = K // P[m, W_BLOCK]
    p0 = gstart[g]
    wp = Wt.ctypes.data + (m * Wt.shape[1] + e) * Wt.shape[2] * 8
    _call_tiles(P[m, FN], t0, t1, wp, acts[m, 0] + p0 * K, acts[m, 1] + p0 * nb * 4,
                acts[m, 2] + p0 * nb * 4, acts[m, 3] + p0 * nb * 4, outs[m] + p0 * N * 4,
                glen[g], K, N, glen[g])
    _fetch_add(stats.ctypes.data + (m * stats.shape[1] + e) * 8, t1 - t0)


@njit(inline="always", nogil=True)
def _items(P, ms, ng, glen, nw):
    """Work items (group, matrix, t0, t1) of matrices ms for every group: each group's tiles
    of a matrix in chunks (16 chunks per thread; with fewer than 8 rows at least
    SMALL_M_CHUNK_BYTES of codes a chunk)."""
    total = 0
    for m in ms:
        total += ng * P[m, TILES]
    n = 0
    per_m = np.empty(len(ms), np.int64)
    for i, m in enumerate(ms):
        per = max(1, total // (max(nw, 1) * 16))
        per_m[i] = per
        for g in range(ng):
            p = per
            if glen[g] < 8:
                p = max(p, SMALL_M_CHUNK_BYTES // P[m, TILE_BYTES])
            n += (P[m, TILES] + p - 1) // p
    items = np.empty((n, 4), np.int64)
    c = 0
    for i, m in enumerate(ms):
        T = P[m, TILES]
        for g in range(ng):
            p = per_m[i]
            if glen[g] < 8:
                p = max(p, SMALL_M_CHUNK_BYTES // P[m, TILE_BYTES])
            for t0 in range(0, T, p):
                items[c, 0] = g
                items[c, 1] = m
                items[c, 2] = t0
                items[c, 3] = min(T, t0 + p)
                c += 1
    return items


@njit(inline="always", nogil=True)
def _run_items(items, P, Wt, acts, outs, gstart, glen, gexp, stats, nw, counter, slot):
    """Every work item, dealt from a shared counter to nw threads (<= 1: this thread)."""
    n = items.shape[0]
    if nw <= 1:
        for c in range(n):
            _run_item(c, items, P, Wt, acts, outs, gstart, glen, gexp, stats)
        return
    addr = counter.ctypes.data + slot * 8
    for _w in prange(nw):
        while True:
            c = _fetch_add(addr, np.int64(1))
            if c >= n:
                break
            _run_item(c, items, P, Wt, acts, outs, gstart, glen, gexp, stats)


@njit(inline="always", nogil=True)
def _silu_quantize(g, u, A, B, zp, qd, dd, bd, zd, gstart, glen, grp, p):
    """Row p: g = silu(g) * u (_swiglu.swiglu_row, the ops' SwiGLU), then its codes for
    down into the group layout."""
    swiglu_row(g, u, g, p)
    q = grp[p]
    s, n = gstart[q], glen[q]
    nb = g.shape[1] // B
    _quantize(g[s:s + n], A, B, zp, qd[s:s + n], dd[s * nb:(s + n) * nb].reshape((nb, n)),
              bd[s * nb:(s + n) * nb].reshape((nb, n)), zd[s * nb:(s + n) * nb].reshape((nb, n)),
              p - s)


@njit(inline="always", nogil=True)
def _weighted_row(y, pos, wts, out, k, t):
    """out[t] = y[pair (t, 0)] * w0, then + y[pair (t, j)] * wj for j = 1 .. k-1."""
    p0 = pos[t * k]
    w0 = wts[t, 0]
    for c in range(out.shape[1]):
        out[t, c] = y[p0, c] * w0
    for j in range(1, k):
        pj = pos[t * k + j]
        wj = wts[t, j]
        for c in range(out.shape[1]):
            out[t, c] += y[pj, c] * wj


@njit(inline="always", nogil=True)
def _al(nbytes):
    return (nbytes + 63) // 64 * 64


@njit(**_PJIT)
def moe_ffn(x, rw, route, ids, wts, Wt, P, out, nw, par_quant, stats, counter, work):
    """out[T, X] = sum over slots j of wts[t, j] * FFN_{ids[t, j]}(x[t]) (see the module doc).

    x float32[T, X] C-contiguous; route: first fill ids and wts from the router rw
    float32[E, X] (_router.route's routing, in this call: decode pays one call a layer);
    ids int64[T, k] expert ids; wts float32[T, k]; Wt int64[3,
    E, W_FIELDS]; P int64[3, N_PARAMS]; out float32[T, X]; nw threads for the tile regions
    (<= 1: this thread); par_quant: quantize, SwiGLU and sum in parallel too (large T);
    stats int64[3, E]: tiles read per matrix and expert are added to it; counter int64[2]
    of zeros, owned by the caller; work: uint8 scratch, reused between calls (fresh arrays
    of a prefill's size cost thousands of page faults a call). Returns 0, or the bytes work
    must have when it is too small (then nothing is computed).
    """
    T, X = x.shape
    k = ids.shape[1]
    E = Wt.shape[1]
    npair = T * k
    F = P[0, N_ROWS]
    nbg, nbu, nbd = X // P[0, W_BLOCK], X // P[1, W_BLOCK], F // P[2, W_BLOCK]
    same = P[0, ACT_BLOCK] == P[1, ACT_BLOCK] and P[0, W_BLOCK] == P[1, W_BLOCK]
    tu = 0 if same else T             # x's codes for up when its format differs from gate's
    pu = 0 if same else npair
    # -- the scratch layout --------------------------------------------------------------
    o_order = 0
    o_pos = o_order + _al(npair * 8)
    o_grp = o_pos + _al(npair * 8)
    o_qa = o_grp + _al(npair * 8)
    o_da = o_qa + _al(T * X)
    o_bsf = o_da + _al(nbg * T * 4)
    o_zb = o_bsf + _al(nbg * T * 4)
    o_qa2 = o_zb + _al(nbg * T * 4)
    o_da2 = o_qa2 + _al(tu * X)
    o_bsf2 = o_da2 + _al(nbu * tu * 4)
    o_zb2 = o_bsf2 + _al(nbu * tu * 4)
    o_qg = o_zb2 + _al(nbu * tu * 4)
    o_dg = o_qg + _al(npair * X)
    o_bg = o_dg + _al(npair * nbg * 4)
    o_zg = o_bg + _al(npair * nbg * 4)
    o_qu = o_zg + _al(npair * nbg * 4)
    o_du = o_qu + _al(pu * X)
    o_bu = o_du + _al(pu * nbu * 4)
    o_zu = o_bu + _al(pu * nbu * 4)
    o_gate = o_zu + _al(npair * nbu * 4)
    o_up = o_gate + _al(npair * F * 4)
    o_yd = o_up + _al(npair * F * 4)
    o_qd = o_yd + _al(npair * X * 4)
    o_dd = o_qd + _al(npair * F)
    o_bd = o_dd + _al(npair * nbd * 4)
    o_zd = o_bd + _al(npair * nbd * 4)
    o_logits = o_zd + _al(npair * nbd * 4)
    need = o_logits + _al(T * E * 4)
    if work.shape[0] < need:
        return need
    if route:
        logits = work[o_logits:o_logits + T * E * 4].view(np.float32).reshape((T, E))
        route_rows(x, rw, k, logits, ids, wts, nw, par_quant)
    order = work[o_order:o_order + npair * 8].view(np.int64)    # sorted position -> pair
    pos = work[o_pos:o_pos + npair * 8].view(np.int64)          # pair -> sorted position
    grp = work[o_grp:o_grp + npair * 8].view(np.int64)          # sorted position -> group
    qa = work[o_qa:o_qa + T * X].view(np.int8).reshape((T, X))
    da = work[o_da:o_da + nbg * T * 4].view(np.float32).reshape((nbg, T))
    bsf = work[o_bsf:o_bsf + nbg * T * 4].view(np.float32).reshape((nbg, T))
    zb = work[o_zb:o_zb + nbg * T * 4].view(np.int32).reshape((nbg, T))
    qa2 = work[o_qa2:o_qa2 + tu * X].view(np.int8).reshape((tu, X))
    da2 = work[o_da2:o_da2 + nbu * tu * 4].view(np.float32).reshape((nbu, tu))
    bsf2 = work[o_bsf2:o_bsf2 + nbu * tu * 4].view(np.float32).reshape((nbu, tu))
    zb2 = work[o_zb2:o_zb2 + nbu * tu * 4].view(np.int32).reshape((nbu, tu))
    qg = work[o_qg:o_qg + npair * X].view(np.int8).reshape((npair, X))
    dg = work[o_dg:o_dg + npair * nbg * 4].view(np.float32)
    bg = work[o_bg:o_bg + npair * nbg * 4].view(np.float32)
    zg = work[o_zg:o_zg + npair * nbg * 4].view(np.int32)
    qu = qg if same else work[o_qu:o_qu + pu * X].view(np.int8).reshape((pu, X))
    du = dg if same else work[o_du:o_du + pu * nbu * 4].view(np.float32)
    bu = bg if same else work[o_bu:o_bu + pu * nbu * 4].view(np.float32)
    zu = work[o_zu:o_zu + npair * nbu * 4].view(np.int32)
    gate = work[o_gate:o_gate + npair * F * 4].view(np.float32).reshape((npair, F))
    up = work[o_up:o_up + npair * F * 4].view(np.float32).reshape((npair, F))
    yd = work[o_yd:o_yd + npair * X * 4].view(np.float32).reshape((npair, X))
    qd = work[o_qd:o_qd + npair * F].view(np.int8).reshape((npair, F))
    dd = work[o_dd:o_dd + npair * nbd * 4].view(np.float32)
    bd = work[o_bd:o_bd + npair * nbd * 4].view(np.float32)
    zd = work[o_zd:o_zd + npair * nbd * 4].view(np.int32)
    # -- pairs sorted by expert (counting sort, stable) -----------------------------------
    cnt = np.zeros(E + 1, np.int64)
    for p in range(npair):
        e = ids[p // k, p % k]
        if e < 0 or e >= E:
            raise ValueError("expert id out of range")
        cnt[e + 1] += 1
    ng = 0
    for e in range(E):
        if cnt[e + 1]:
            ng += 1
        cnt[e + 1] += cnt[e]
    gstart = np.empty(ng, np.int64)
    glen = np.empty(ng, np.int64)
    gexp = np.empty(ng, np.int64)
    gid = np.empty(E, np.int64)
    g = 0
    for e in range(E):
        n = cnt[e + 1] - cnt[e]
        if n:
            gstart[g], glen[g], gexp[g] = cnt[e], n, e
            gid[e] = g
            g += 1
    for p in range(npair):
        e = ids[p // k, p % k]
        i = cnt[e]
        cnt[e] += 1
        order[i] = p
        pos[p] = i
        grp[i] = gid[e]
    # -- x quantized for gate (and up, if its format differs), gathered per group -----------
    if par_quant:
        for r in prange(T):
            _quantize(x, P[0, ACT_BLOCK], P[0, W_BLOCK], P[0, ZP], qa, da, bsf, zb, r)
            if not same:
                _quantize(x, P[1, ACT_BLOCK], P[1, W_BLOCK], P[1, ZP], qa2, da2, bsf2, zb2, r)
    else:
        for r in range(T):
            _quantize(x, P[0, ACT_BLOCK], P[0, W_BLOCK], P[0, ZP], qa, da, bsf, zb, r)
            if not same:
                _quantize(x, P[1, ACT_BLOCK], P[1, W_BLOCK], P[1, ZP], qa2, da2, bsf2, zb2, r)
    if par_quant:
        for p in prange(npair):
            _gather(qa, da, bsf, P[0, ZP], order, k, gstart, glen, grp, qg, dg, bg, zg, p)
            if not same:
                _gather(qa2, da2, bsf2, P[1, ZP], order, k, gstart, glen, grp, qu, du, bu, zu, p)
    else:
        for p in range(npair):
            _gather(qa, da, bsf, P[0, ZP], order, k, gstart, glen, grp, qg, dg, bg, zg, p)
            if not same:
                _gather(qa2, da2, bsf2, P[1, ZP], order, k, gstart, glen, grp, qu, du, bu, zu, p)
    if same:        # up's codes are gate's; only its zero point's zb differs
        for i in range(npair * nbu):
            zu[i] = block_zb(bg[i], P[1, ZP])
    # -- gate and up of every group: one parallel region ------------------------------------
    acts = np.empty((3, 4), np.int64)
    acts[0, 0], acts[0, 1], acts[0, 2], acts[0, 3] = qg.ctypes.data, dg.ctypes.data, bg.ctypes.data, zg.ctypes.data
    acts[1, 0], acts[1, 1], acts[1, 2], acts[1, 3] = qu.ctypes.data, du.ctypes.data, bu.ctypes.data, zu.ctypes.data
    acts[2, 0], acts[2, 1], acts[2, 2], acts[2, 3] = qd.ctypes.data, dd.ctypes.data, bd.ctypes.data, zd.ctypes.data
    outs = np.empty(3, np.int64)
    outs[0], outs[1], outs[2] = gate.ctypes.data, up.ctypes.data, yd.ctypes.data
    items = _items(P, (0, 1), ng, glen, nw)
    _run_items(items, P, Wt, acts, outs, gstart, glen, gexp, stats, nw, counter, 0)
    # -- SwiGLU, quantized for down ---------------------------------------------------------
    A, B, zp = P[2, ACT_BLOCK], P[2, W_BLOCK], P[2, ZP]
    if par_quant:
        for p in prange(npair):
            _silu_quantize(gate, up, A, B, zp, qd, dd, bd, zd, gstart, glen, grp, p)
    else:
        for p in range(npair):
            _silu_quantize(gate, up, A, B, zp, qd, dd, bd, zd, gstart, glen, grp, p)
    # -- down of every group, then the weighted sum per token -------------------------------
    items = _items(P, (2,), ng, glen, nw)
    _run_items(items, P, Wt, acts, outs, gstart, glen, gexp, stats, nw, counter, 1)
    if par_quant:
        for t in prange(T):
            _weighted_row(yd, pos, wts, out, k, t)
    else:
        for t in range(T):
            _weighted_row(yd, pos, wts, out, k, t)
    return 0
