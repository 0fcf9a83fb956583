"""Decode steps through static device buffers, replayed as CUDA graphs on a GPU.

A decode step (one token per sequence) of a small model is a few hundred kernel launches of
a few microseconds each; issued one by one from Python they cost 30-55 ms a step on an H200,
whatever the batch (docs/backends.md). Recorded once as a CUDA graph and replayed, the step
is one launch. A graph replays fixed addresses and shapes, so a step is padded to a bucket:
rows (sequences) and gathered KV blocks each rounded up to a power of two. Its inputs (token
ids, positions, K/V slots, block tables) are written into one pinned host buffer and copied
to the device in one transfer; every per-step value the layers need (rope angles, the
attention mask) is computed on the device from them (`StaticStep`, read by TorchOps).

Padding rows read token 0 at position 0 and write their K/V into a scratch block the pool
keeps for them (TorchKVCache.scratch_block); their logits are dropped. Blocks past a row's
position are masked, so a bucket's extra blocks change which keys are read, not the result's
meaning (the float sums can round differently from an unpadded step's, as any change of
batch shape can on this backend: TorchOps.rows_exact is False).

`capture=False` runs the same padded static forward eagerly each step: the CPU tests drive
every part of this path except the record and the replay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from edgeinfer.backends.base import ForwardBatch

log = logging.getLogger(__name__)

MAX_ROWS = 64       # larger decode batches run eagerly


def bucket(n: int) -> int:
    """The power of two at or above n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class StaticStep:
    """A padded decode step's inputs on the device, at fixed addresses for its bucket."""
    ids: torch.Tensor        # int64 [S]
    positions: torch.Tensor  # int64 [S]
    slots: torch.Tensor      # int64 [S]
    tables: torch.Tensor     # int64 [S, NB]
    block_size: int


@dataclass
class _Recorded:
    graph: object            # torch.cuda.CUDAGraph
    logits: torch.Tensor     # its output, [S, vocab], in the graphs' memory pool


class DecodeGraphs:
    """One owner for the decode path's staging buffers and recorded graphs, by bucket."""

    def __init__(self, model, kv, device: torch.device, capture: bool):
        self.model, self.kv, self.device, self.capture = model, kv, device, capture
        self.block_size = kv.block_size
        self.scratch = kv.scratch_block         # = the pool's block count (TorchOps)
        self.max_blocks = bucket(self.scratch)
        n = 3 * MAX_ROWS + MAX_ROWS * self.max_blocks
        pin = device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, int], _Recorded] = {}
        self._pool = None
        self._stream = None
        self.disabled = False    # set when a record fails: every later step runs eagerly

    @staticmethod
    def applies(batch: ForwardBatch) -> bool:
        """A pure decode step: one token per sequence, each sampled, nothing else asked."""
        T = batch.num_tokens
        return (0 < T <= MAX_ROWS and batch.block_tables.shape[0] == T
                and len(batch.logits_indices) == T and batch.hidden_indices is None
                and batch.embd_rows is None and batch.window_tables is None
                and bool((batch.logits_indices == np.arange(T)).all()))

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [T, vocab] of a pure decode step, or None when it falls outside the buckets
        (the caller runs it eagerly then)."""
        if self.disabled:
            return None
        T = batch.num_tokens
        S, NB = self.bucket_of(batch)
        if NB > self.max_blocks:
            return None
        self._stage(batch, S, NB)
        key = (S, NB)
        rec = self._graphs.get(key)
        if rec is not None:
            rec.graph.replay()
            return rec.logits[:T]
        if not self.capture:
            return self.model.forward(self._padded(S, NB), self.kv)[:T]
        logits = self._warm_and_record(key, S, NB)
        return None if logits is None else logits[:T]

    def close(self) -> None:
        """Let go of the recordings, their memory pool and the model (an unload)."""
        self._graphs.clear()
        self._pool = self._stream = self.model = self.kv = None
        self.disabled = True

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def bucket_of(self, batch: ForwardBatch) -> tuple[int, int]:
        """(rows, blocks) of the bucket a pure decode step pads to."""
        need = int(batch.positions.max()) // self.block_size + 1
        return bucket(batch.num_tokens), bucket(need)

    # -- inputs ----------------------------------------------------------------------------
    def _regions(self, S: int, NB: int) -> tuple[slice, slice, slice, slice]:
        m = MAX_ROWS
        return (slice(0, S), slice(m, m + S), slice(2 * m, 2 * m + S),
                slice(3 * m, 3 * m + S * NB))

    def _stage(self, batch: ForwardBatch, S: int, NB: int) -> None:
        """The step's inputs, padded to (S, NB), into the host buffer, then one copy over."""
        T, h, bs = batch.num_tokens, self._host_np, self.block_size
        r_ids, r_pos, r_slot, r_tab = self._regions(S, NB)
        scratch_slot = self.scratch * bs
        ids, pos, slots = h[r_ids], h[r_pos], h[r_slot]
        ids[:T], ids[T:] = batch.token_ids, 0
        pos[:T], pos[T:] = batch.positions, 0
        slots[:T], slots[T:] = batch.slot_mapping, scratch_slot
        tab = h[r_tab].reshape(S, NB)
        tab[:] = self.scratch
        width = min(NB, batch.block_tables.shape[1])
        tab[:T, :width] = batch.block_tables[:, :width]
        end = r_tab.stop
        # the previous step's copy has finished: its logits were read back on the host
        self._dev[:end].copy_(self._host[:end], non_blocking=True)

    def _padded(self, S: int, NB: int) -> ForwardBatch:
        """A ForwardBatch whose inputs are the device buffers' views for this bucket."""
        r_ids, r_pos, r_slot, r_tab = self._regions(S, NB)
        d = self._dev
        step = StaticStep(d[r_ids], d[r_pos], d[r_slot], d[r_tab].view(S, NB), self.block_size)
        rows = np.arange(S)
        batch = ForwardBatch(step.ids, np.zeros(S, np.int32), np.zeros(S, np.int64),
                             rows.astype(np.int32), np.zeros((S, NB), np.int32),
                             rows.astype(np.int64))
        batch.cache["torch_static"] = step
        return batch

    # -- record ----------------------------------------------------------------------------
    def _warm_and_record(self, key: tuple[int, int], S: int, NB: int) -> torch.Tensor | None:
        """The first step of a bucket: run eagerly on a side stream (CUDA graphs' warm-up:
        lazy kernel and library set-up, and TorchOps' per-device constants, happen outside
        the record), then record the same forward. Its logits are the warm-up's. On any
        failure this model's decode steps run op by op from then on: the warm-up's logits
        if it got that far, else None (the caller runs the step op by op)."""
        logits = None
        try:
            side, main = self._side_stream(), torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                logits = self.model.forward(self._padded(S, NB), self.kv)
            main.wait_stream(side)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                out = self.model.forward(self._padded(S, NB), self.kv)
            self._pool = g.pool()
            self._graphs[key] = _Recorded(g, out)
        except Exception as e:      # e.g. a kernel that cannot be recorded
            log.warning("decode steps of this model run op by op: CUDA graph recording "
                        "failed (%s: %s)", type(e).__name__, e)
            self.disabled = True
            self._graphs.clear()
        return logits
