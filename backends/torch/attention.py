"""Paged attention in torch: gather each sequence's K/V through its block table, pad the
sequences' query chunks to one batch, and run `scaled_dot_product_attention` once per layer
with an explicit boolean mask.

The mask is causal in absolute positions (a query chunk that starts at position p attends to
all cached keys < p plus its own chunk causally), which `is_causal=True` cannot express, and
it applies the sliding window. Sliding-window layers gather only the blocks the window can
reach, so their cost does not grow with the context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from edgeinfer.backends.base import ForwardBatch

_NATIVE_GQA = ("cpu", "cuda")   # SDPA's enable_gqa is tested on these


@dataclass
class _Gather:
    """Per (step, window): which blocks to read for each sequence and the mask over them."""
    tables: torch.Tensor   # int64 [S, NB] block ids (clamped; beyond-range keys are masked)
    mask: torch.Tensor     # bool [S, 1, M, NB * block_size]


@dataclass
class StepLayout:
    """How the flat batch maps onto [S sequences, M padded query rows], built once per step."""
    slots: torch.Tensor        # int64 [T] flat cache slots for this step's K/V
    pad_index: torch.Tensor    # int64 [T] row of each token in the [S * M] padded layout
    S: int
    M: int
    block_size: int
    q_pos: np.ndarray          # int64 [S, M] absolute query positions (padding repeats the last)
    tables_np: np.ndarray      # int64 [S, max_blocks]
    device: torch.device
    gathers: dict[int, _Gather] = field(default_factory=dict)
    # int64 [S, M] the last position each row attends to: its own, or its image's last
    # (ForwardBatch.attn_until: bidirectional inside an image); None = q_pos
    q_hi: np.ndarray | None = None

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device) -> "StepLayout":
        seq = batch.token_seq.astype(np.int64)
        S = int(batch.block_tables.shape[0])
        counts = np.bincount(seq, minlength=S)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        M = int(counts.max())
        local = np.arange(len(seq)) - starts[seq]   # tokens of a sequence are contiguous
        pad_index = seq * M + local
        q_pos = np.empty((S, M), np.int64)
        until = batch.attn_until
        q_hi = np.empty((S, M), np.int64) if until is not None else None
        for s in range(S):  # per sequence, not per token: S is at most the running batch
            p = batch.positions[starts[s]:starts[s] + counts[s]]
            q_pos[s, :counts[s]] = p
            q_pos[s, counts[s]:] = p[-1] if len(p) else 0
            if q_hi is not None:
                u = until[starts[s]:starts[s] + counts[s]]
                q_hi[s, :counts[s]] = u
                q_hi[s, counts[s]:] = u[-1] if len(u) else 0
        return cls(torch.from_numpy(batch.slot_mapping.astype(np.int64)).to(device),
                   torch.from_numpy(pad_index).to(device), S, M, block_size, q_pos,
                   batch.block_tables.astype(np.int64), device, q_hi=q_hi)

    def gather(self, window: int) -> _Gather:
        g = self.gathers.get(window)
        if g is None:
            g = self.gathers[window] = self._make_gather(window)
        return g

    def _make_gather(self, window: int) -> _Gather:
        bs = self.block_size
        hi = self.q_pos if self.q_hi is None else self.q_hi
        last = hi.max(axis=1)                             # [S]
        first_pos = self.q_pos.min(axis=1) - window + 1 if window > 0 else np.zeros(self.S, np.int64)
        first_blk = np.maximum(first_pos, 0) // bs        # [S]
        nb = int((last // bs - first_blk).max()) + 1
        blk_idx = first_blk[:, None] + np.arange(nb)      # [S, NB] logical block numbers
        tables = np.take_along_axis(self.tables_np, np.minimum(blk_idx, self.tables_np.shape[1] - 1), 1)
        k_pos = (blk_idx[:, :, None] * bs + np.arange(bs)).reshape(self.S, 1, nb * bs)
        q = self.q_pos[:, :, None]
        mask = k_pos <= hi[:, :, None]
        if window > 0:
            mask &= k_pos > q - window
        return _Gather(torch.from_numpy(tables).to(self.device),
                       torch.from_numpy(mask[:, None]).to(self.device))


@dataclass
class StaticLayout:
    """A padded decode step's layout, computed on the device from its inputs
    (graphs.StaticStep): one query row per sequence, every block of the bucket gathered and
    masked by position, so nothing in it depends on host values (a CUDA graph replays it)."""
    slots: torch.Tensor        # int64 [S]
    positions: torch.Tensor    # int64 [S]
    tables: torch.Tensor       # int64 [S, NB]
    S: int
    block_size: int
    M: int = 1
    gathers: dict[int, _Gather] = field(default_factory=dict)

    @classmethod
    def of(cls, step) -> "StaticLayout":
        return cls(step.slots, step.positions, step.tables, int(step.tables.shape[0]),
                   step.block_size)

    def gather(self, window: int) -> _Gather:
        g = self.gathers.get(window)
        if g is None:
            L = self.tables.shape[1] * self.block_size
            k_pos = torch.arange(L, device=self.tables.device)[None, :]
            q = self.positions[:, None]
            mask = k_pos <= q
            if window > 0:
                mask = mask & (k_pos > q - window)
            g = self.gathers[window] = _Gather(self.tables, mask[:, None, None, :])
        return g


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store this step's K/V rows [T, KVH, D] at flat slots of [blocks, block_size, KVH, D]."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    layout: StepLayout | StaticLayout, scale: float,
                    window: int) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D], attending through the block tables (see module doc)."""
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    S, M = layout.S, layout.M
    g = layout.gather(window)
    L = g.tables.shape[1] * layout.block_size
    # [S, NB, bs, KVH, D] -> [S, KVH, L, D], in the compute dtype
    k = k_cache[g.tables].reshape(S, L, kvh, D).transpose(1, 2).to(q.dtype)
    v = v_cache[g.tables].reshape(S, L, kvh, D).transpose(1, 2).to(q.dtype)
    # decode (one token per sequence, in sequence order) needs no padding: the same values
    one_row = M == 1 and T == S
    if one_row:
        qp = q.reshape(S, 1, H, D).transpose(1, 2)
    else:
        qp = q.new_zeros(S * M, H, D)
        qp[layout.pad_index] = q
        qp = qp.view(S, M, H, D).transpose(1, 2)           # [S, H, M, D]
    gqa = {}
    if kvh != H:
        if q.device.type in _NATIVE_GQA:
            gqa = {"enable_gqa": True}
        else:  # MPS: expand K/V heads rather than rely on enable_gqa there
            k = k.repeat_interleave(H // kvh, dim=1)
            v = v.repeat_interleave(H // kvh, dim=1)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=g.mask, scale=scale, **gqa)
    o = o.transpose(1, 2).reshape(S * M, H, D)
    return o if one_row else o[layout.pad_index]
