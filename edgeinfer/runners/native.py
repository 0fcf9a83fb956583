"""The model runner: owns the weights and the KV pool on one backend and executes one step.

A step is the scheduler's list of chunks (decode tokens and prefill chunks of many sequences);
the runner flattens them into one `ForwardBatch`, runs the model once, and returns logits for
the chunks that need a sample, in chunk order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.gguf_file import GGUFFile, read_gguf
from edgeinfer.formats.model_config import ModelConfig, load_model_config


class _Seq(Protocol):
    block_table: Sequence[int]


class Chunk(Protocol):
    """What the runner needs of a scheduled chunk (edgeinfer.engine.scheduler.ScheduledChunk)."""
    seq: _Seq
    start: int
    token_ids: Sequence[int]
    needs_logits: bool


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv(cfg: ModelConfig, budget_bytes: int, bytes_per_value: int, block_size: int = 16,
            min_tokens: int = 0) -> KVPlan:
    """Size the pool from a memory budget with 2 x layers x kv_heads x head_dim x bytes."""
    per_token = cfg.kv_bytes_per_token(bytes_per_value)
    tokens = max(budget_bytes // per_token, min_tokens)
    return KVPlan(max(1, tokens // block_size), block_size, per_token)


def make_ops(backend: str, batch_invariant: bool = True):
    if backend == "cpu":
        from edgeinfer.backends.cpu.ops import CpuOps
        return CpuOps(batch_invariant=batch_invariant)
    if backend == "torch" or backend.startswith("torch:"):
        from edgeinfer.backends.torch.ops import TorchOps
        return TorchOps(device=backend.partition(":")[2] or None)
    raise ValueError(f"unknown backend {backend!r}")


class ModelRunner:
    def __init__(self, gf: GGUFFile, cfg: ModelConfig, ops, plan: KVPlan):
        from edgeinfer.models import build_model
        self.gf, self.cfg, self.ops, self.plan = gf, cfg, ops, plan
        self.model = build_model(cfg, ops, gf)
        if getattr(ops, "weights_copied", False):
            gf.release_pages()      # the weights live in the backend's own memory now
        self.kv = ops.new_kv_cache(cfg.n_layers, plan.num_blocks, plan.block_size,
                                   cfg.n_kv_head, cfg.head_dim)

    @property
    def weights_format(self) -> str:
        """How weights sit in memory, for `show`/`ps` (the llama.cpp runner has one too)."""
        return getattr(self.ops, "weights_format", "gguf (quantized)")

    @classmethod
    def load(cls, path: str, backend: str = "cpu", kv_budget_bytes: int = 1 << 30,
             block_size: int = 16, min_kv_tokens: int = 0,
             batch_invariant: bool = True) -> "ModelRunner":
        gf = read_gguf(path)
        cfg = load_model_config(gf)
        ops = make_ops(backend, batch_invariant)
        fit = getattr(ops, "fit_kv_budget", None)
        if fit is not None:  # device backends: refuse early, size the pool from free memory
            kv_budget_bytes = fit(gf, kv_budget_bytes)
        plan = plan_kv(cfg, kv_budget_bytes, ops.kv_bytes_per_value, block_size, min_kv_tokens)
        return cls(gf, cfg, ops, plan)

    def build_batch(self, chunks: Sequence[Chunk]) -> ForwardBatch:
        bs = self.plan.block_size
        n = sum(len(c.token_ids) for c in chunks)
        token_ids = np.empty(n, np.int32)
        positions = np.empty(n, np.int32)
        token_seq = np.empty(n, np.int32)
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = np.zeros((len(chunks), max_blocks), np.int32)
        logits_rows = []
        t = 0
        for s, c in enumerate(chunks):
            m = len(c.token_ids)
            token_ids[t:t + m] = c.token_ids
            positions[t:t + m] = np.arange(c.start, c.start + m, dtype=np.int32)
            token_seq[t:t + m] = s
            tables[s, :len(c.seq.block_table)] = c.seq.block_table
            t += m
            if c.needs_logits:
                logits_rows.append(t - 1)
        blocks = tables[token_seq, positions // bs].astype(np.int64)
        slots = blocks * bs + positions % bs
        return ForwardBatch(token_ids, positions, slots, token_seq, tables,
                            np.array(logits_rows, np.int64))

    def execute(self, chunks: Sequence[Chunk],
                block_copies: Sequence[tuple[int, int]] = ()) -> np.ndarray:
        """Run one step; returns float32 logits [number of chunks needing logits, vocab]."""
        begin = getattr(self.ops, "begin_step", None)
        if begin is not None:
            begin()
        if block_copies:
            self.ops.copy_blocks(self.kv, list(block_copies))
        batch = self.build_batch(chunks)
        if not len(batch.logits_indices):
            batch.logits_indices = np.array([batch.num_tokens - 1], np.int64)
            self.model.forward(batch, self.kv)
            return np.empty((0, self.cfg.vocab_size), np.float32)
        return self.ops.to_numpy(self.model.forward(batch, self.kv))


def resolve_backend(path: str, backend: str) -> str:
    """Resolve "auto": torch on cuda, then mps, else the numba cpu backend; llama.cpp for
    architectures the native models do not cover. Other names pass through."""
    if backend != "auto":
        return backend
    from edgeinfer.backends.torch.device import choose_backend
    gf = read_gguf(path)
    arch = gf.metadata.get("general.architecture")
    gf.close()
    return choose_backend("auto", arch if isinstance(arch, str) else None)


def make_runner(path: str, backend: str = "cpu", kv_budget_bytes: int = 1 << 30,
                block_size: int = 16, min_kv_tokens: int = 0, max_running_seqs: int = 16,
                max_tokens_per_step: int = 512, batch_invariant: bool = True):
    """A ModelRunner on a native backend, or the llama.cpp runner (same interface).
    "auto" picks torch on cuda/mps, else the numba cpu backend, and llama.cpp for
    architectures the native models do not cover."""
    backend = resolve_backend(path, backend)
    if backend == "llamacpp":
        from edgeinfer.runners.llamacpp.runner import LlamaCppRunner
        return LlamaCppRunner.load(path, kv_budget_bytes, block_size, min_kv_tokens,
                                   max_running_seqs=max_running_seqs,
                                   max_tokens_per_step=max_tokens_per_step)
    return ModelRunner.load(path, backend, kv_budget_bytes=kv_budget_bytes,
                            block_size=block_size, min_kv_tokens=min_kv_tokens,
                            batch_invariant=batch_invariant)
