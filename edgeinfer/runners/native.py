"""The native runner: our model files on a backend's ops (numba CPU or torch), one step at a
time.

A step's spans (decode tokens and prefill chunks of many requests) are flattened into one
`ForwardBatch`, the model runs once over it with paged attention through each span's block
table, and the logits of the spans that sample go to the sampling stage.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgeinfer.backends.base import ForwardBatch, Ops
from edgeinfer.formats.gguf_file import GGUFFile, read_gguf
from edgeinfer.formats.model_config import ModelConfig, load_model_config
from edgeinfer.runners.base import KVPlan, ScheduledSpan, StepPlan, StepResult, plan_kv
from edgeinfer.runners.sampling_stage import SamplingStage


def make_ops(backend: str, batch_invariant: bool = False, governor=None,
             repack: bool | None = None, torch_dtype: str | None = None) -> Ops:
    """The ops object for a resolved native backend name (`cpu`, `torch[:device]`)."""
    if backend == "cpu":
        from edgeinfer.backends.cpu.ops import CpuOps
        return CpuOps(batch_invariant=batch_invariant, governor=governor, repack=repack)
    if backend == "torch" or backend.startswith("torch:"):
        from edgeinfer.backends.torch.ops import TorchOps
        return TorchOps(device=backend.partition(":")[2] or None, dtype=torch_dtype)
    raise ValueError(f"unknown native backend {backend!r}")


def build_forward_batch(spans: Sequence[ScheduledSpan], block_size: int) -> ForwardBatch:
    n = sum(len(s.token_ids) for s in spans)
    token_ids = np.empty(n, np.int32)
    positions = np.empty(n, np.int32)
    token_seq = np.empty(n, np.int32)
    max_blocks = max(len(s.block_table) for s in spans)
    tables = np.zeros((len(spans), max_blocks), np.int32)
    logits_rows = []
    t = 0
    for i, s in enumerate(spans):
        m = len(s.token_ids)
        token_ids[t:t + m] = s.token_ids
        positions[t:t + m] = np.arange(s.start, s.start + m, dtype=np.int32)
        token_seq[t:t + m] = i
        tables[i, :len(s.block_table)] = s.block_table
        t += m
        if s.sample:
            logits_rows.append(t - 1)
    blocks = tables[token_seq, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    return ForwardBatch(token_ids, positions, slots, token_seq, tables,
                        np.array(logits_rows, np.int64))


class ModelRunner:
    """Implements edgeinfer.runners.base.Runner with a native model on `ops`."""
    prefix_caching = True

    def __init__(self, gf: GGUFFile, cfg: ModelConfig, ops: Ops, kv_plan: KVPlan):
        from edgeinfer.models import build_model
        self.gf, self.cfg, self.ops, self.kv_plan = gf, cfg, ops, kv_plan
        self.kind = ops.name
        self.model = build_model(cfg, ops, gf)
        if ops.weights_copied:
            gf.release_pages()      # the weights live in the backend's own memory now
        self.kv = ops.new_kv_cache(cfg.n_layers, kv_plan.num_blocks, kv_plan.block_size,
                                   cfg.n_kv_head, cfg.head_dim)
        self._tokenizer = None
        self.sampling = SamplingStage(self.tokenizer.eot_ids)

    @classmethod
    def load(cls, path: str, backend: str = "cpu", kv_budget_bytes: int = 1 << 30,
             block_size: int = 16, min_kv_tokens: int = 0, batch_invariant: bool = False,
             governor=None, repack: bool | None = None,
             torch_dtype: str | None = None) -> "ModelRunner":
        gf = read_gguf(path)
        try:
            cfg = load_model_config(gf)
            ops = make_ops(backend, batch_invariant, governor, repack, torch_dtype)
            kv_budget_bytes = ops.fit_kv_budget(gf, kv_budget_bytes)
            plan = plan_kv(cfg, kv_budget_bytes, ops.kv_bytes_per_value, block_size,
                           min_kv_tokens)
            return cls(gf, cfg, ops, plan)
        except BaseException:
            gf.close()          # a failed load keeps no mapping open
            raise

    # -- what the engine reads -------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from edgeinfer.formats.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_gguf(self.gf.metadata)
        return self._tokenizer

    @property
    def weights_format(self) -> str:
        return self.ops.weights_format

    @property
    def kv_bytes(self) -> int:
        return int(self.kv.nbytes)

    # -- one step --------------------------------------------------------------------------
    def forward(self, spans: Sequence[ScheduledSpan],
                block_copies: Sequence[tuple[int, int]] = ()) -> np.ndarray:
        """Run the model over the spans; float32 logits [spans that sample, vocab]."""
        self.ops.begin_step()
        if block_copies:
            self.ops.copy_blocks(self.kv, list(block_copies))
        if not spans:
            return np.empty((0, self.cfg.vocab_size), np.float32)
        batch = build_forward_batch(spans, self.kv_plan.block_size)
        if not len(batch.logits_indices):
            batch.logits_indices = np.array([batch.num_tokens - 1], np.int64)
            self.model.forward(batch, self.kv)
            return np.empty((0, self.cfg.vocab_size), np.float32)
        return self.ops.to_numpy(self.model.forward(batch, self.kv))

    def execute(self, plan: StepPlan) -> StepResult:
        self.sampling.begin(plan)
        logits = self.forward(plan.spans, plan.block_copies)
        return self.sampling.sample([s for s in plan.spans if s.sample], logits)

    def close(self) -> None:
        """Drop the weights, the KV pool and the file mapping (deterministic unload)."""
        self.model = None
        self.kv = None
        self.sampling = SamplingStage()
        self.gf.close()
