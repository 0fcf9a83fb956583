"""The native runner: our model files on a backend's ops (numba CPU or torch), one step at a
time.

A step's spans (decode tokens and prefill chunks of many requests) are flattened into one
`ForwardBatch`, the model runs once over it with paged attention through each span's block
table, and the logits of the spans that sample go to the sampling stage.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np

from edgeinfer.backends.base import ForwardBatch, Ops
from edgeinfer.formats.gguf_file import GGUFFile, read_gguf
from edgeinfer.formats.model_config import ModelConfig, load_model_config
from edgeinfer.models.base import Model
from edgeinfer.runners.base import (KVPlan, ScheduledSpan, StepPlan, StepResult, plan_kv,
                                    start_thread)
from edgeinfer.runners.logprobs import score_spans
from edgeinfer.runners.pooling import Pooler, pooling_of
from edgeinfer.runners.sampling_stage import SamplingStage


def make_ops(backend: str, batch_invariant: bool = False, governor=None,
             repack: bool | None = None, torch_dtype: str | None = None,
             kv_cache_type: str | None = None, threads: int | None = None,
             repack_cache: str | None = None, repack_cache_bytes: int = 0,
             torch_graphs: bool = True) -> Ops:
    """The ops object for a resolved native backend name (`cpu`, `torch[:device]`).
    `threads`: a fixed CPU thread count when no governor is given (None: measured);
    `repack_cache`: where the CPU backend keeps repacked weights (None: nowhere);
    `torch_graphs`: torch on CUDA records decode steps as graphs (backends/torch/graphs.py)."""
    if backend == "cpu":
        from edgeinfer.backends.cpu.ops import CpuOps
        return CpuOps(batch_invariant=batch_invariant, governor=governor, repack=repack,
                      kv_cache_type=kv_cache_type, threads=threads, repack_cache=repack_cache,
                      repack_cache_bytes=repack_cache_bytes)
    if backend == "torch" or backend.startswith("torch:"):
        from edgeinfer.backends.torch.ops import TorchOps
        return TorchOps(device=backend.partition(":")[2] or None, dtype=torch_dtype,
                        kv_cache_type=kv_cache_type, graphs=None if torch_graphs else False)
    raise ValueError(f"unknown native backend {backend!r}")


def build_forward_batch(spans: Sequence[ScheduledSpan], block_size: int,
                        window_layer: tuple[bool, ...] = ()) -> ForwardBatch:
    """The step's spans as one flat batch. `window_layer` (a plan with a sliding-window
    group): per layer, whether it reads and writes through the spans' window tables; a
    span without one (tests and benchmarks that hand out blocks themselves) uses its block
    table there too."""
    n = sum(len(s.token_ids) for s in spans)
    token_ids = np.empty(n, np.int32)
    positions = np.empty(n, np.int32)
    token_seq = np.empty(n, np.int32)
    max_blocks = max(len(s.block_table) for s in spans)
    tables = np.zeros((len(spans), max_blocks), np.int32)
    wtables = np.zeros((len(spans), max_blocks), np.int32) if window_layer else None
    logits_rows = []
    t = 0
    for i, s in enumerate(spans):
        m = len(s.token_ids)
        token_ids[t:t + m] = s.token_ids
        positions[t:t + m] = np.arange(s.start, s.start + m, dtype=np.int32)
        token_seq[t:t + m] = i
        tables[i, :len(s.block_table)] = s.block_table
        if wtables is not None:
            w = s.window_table or s.block_table
            # released entries (-1) are never read: block 0 keeps every address in the pool
            wtables[i, :len(w)] = w
        t += m
        if s.sample:
            logits_rows.extend(range(t - 1 - s.num_draft, t))
    blocks = tables[token_seq, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    batch = ForwardBatch(token_ids, positions, slots, token_seq, tables,
                         np.array(logits_rows, np.int64))
    if wtables is not None:
        np.maximum(wtables, 0, out=wtables)
        wblocks = wtables[token_seq, positions // block_size].astype(np.int64)
        batch.window_tables = wtables
        batch.window_slots = wblocks * block_size + positions % block_size
        batch.window_layer = window_layer
    return batch


def _forward_owner_says(model, promise: str) -> bool:
    """Whether the class whose forward runs makes `promise` itself: a subclass with a forward
    of its own does not inherit it (it could break it silently)."""
    owner = next((c for c in type(model).__mro__ if "forward" in vars(c)), None)
    return owner is not None and bool(vars(owner).get(promise, False))


def _build_tokenizer(metadata: dict):
    from edgeinfer.formats.tokenizer import Tokenizer
    return Tokenizer.from_gguf(metadata)


def _start_tokenizer(gf: GGUFFile) -> concurrent.futures.Future:
    """The vocabulary (Python objects, ~0.1 s for 150k tokens) built on a thread, beside the
    kernels' loading and the weights' repacking, which run without the GIL: the engine
    waits for it only when it needs the end-of-generation ids, after the model is built."""
    return start_thread(_build_tokenizer, gf.metadata, name="edgeinfer-tokenizer")


class ModelRunner:
    """Implements edgeinfer.runners.base.Runner with a native model on `ops`."""
    prefix_caching = True

    def __init__(self, gf: GGUFFile, cfg: ModelConfig, ops: Ops, kv_plan: KVPlan,
                 tokenizer_job: concurrent.futures.Future | None = None):
        """`tokenizer_job`: the vocabulary's build, started as soon as the header was read
        (load() does), or None to start it here."""
        from edgeinfer.models import build_model
        self.gf, self.cfg, self.ops, self.kv_plan = gf, cfg, ops, kv_plan
        self.kind = ops.name
        self._weights_bytes = ops.weights_nbytes(gf)
        self._tokenizer = None
        self._tokenizer_job = (tokenizer_job if tokenizer_job is not None
                               else _start_tokenizer(gf))
        # the norms and biases, copied one by one as the layers load, are scattered through
        # the file: with a cold page cache, one batch of reads instead of ~120 in a row
        # (Qwen2.5-Coder 0.5B, its GGUF evicted: `run --no-daemon` 0.74-0.93 -> 0.54-0.59 s)
        gf.will_need([name for name, t in gf.tensors.items() if len(t.shape) == 1])
        self.model: Model = build_model(cfg, ops, gf)
        if ops.weights_copied:
            gf.release_pages()      # the weights live in the backend's own memory now
        # per layer: whether it keeps its K/V in the sliding-window group's pool
        self.window_layer: tuple[bool, ...] = ()
        layer_blocks = None
        if kv_plan.window_layers:
            wl = set(kv_plan.window_layers)
            self.window_layer = tuple(i in wl for i in range(cfg.n_layers))
            layer_blocks = [kv_plan.window_blocks if w else kv_plan.num_blocks
                            for w in self.window_layer]
            self.kv = ops.new_kv_cache(cfg.n_layers, kv_plan.num_blocks, kv_plan.block_size,
                                       cfg.n_kv_head, cfg.head_dim, layer_blocks=layer_blocks)
        else:
            self.kv = ops.new_kv_cache(cfg.n_layers, kv_plan.num_blocks, kv_plan.block_size,
                                       cfg.n_kv_head, cfg.head_dim)
        # pure decode steps through the backend's recorded graphs (torch on CUDA), if any
        self._decode = (ops.decode_graphs(self.model, self.kv)
                        if _forward_owner_says(self.model, "graph_safe") else None)
        self.sampling = SamplingStage(self.tokenizer.eot_ids)
        self._prompts: dict[int, tuple[int, ...]] = {}   # prompt logprobs' targets
        self._images: dict[int, tuple] = {}     # request id -> its prompt's ImageSpans
        # embeddings: the model's pooling, and per-request pools (non-causal encoders compute
        # a prompt only once all of it is scheduled)
        self.pooling = pooling_of(gf.metadata, cfg.arch)
        self.pooler = Pooler(whole_prompt=self.model.non_causal)
        # encoders (bert) have no LM head: the engine refuses generation on them
        self.embedding_only = self.model.embedding_only
        if self.pooling == "rank" and not self.model.has_rank_head:
            self.pooling = "cls"        # a rank pooling_type without a head: plain CLS vectors

    @classmethod
    def load(cls, path: str, backend: str = "cpu", kv_budget_bytes: int = 1 << 30,
             block_size: int = 16, min_kv_tokens: int = 0, batch_invariant: bool = False,
             governor=None, repack: bool | None = None,
             torch_dtype: str | None = None,
             kv_cache_type: str | None = None, max_running_seqs: int = 16,
             max_tokens_per_step: int = 512, threads: int | None = None,
             repack_cache: str | None = None, repack_cache_bytes: int = 0,
             torch_graphs: bool = True) -> "ModelRunner":
        gf = read_gguf(path, compiled_walk=backend == "cpu")     # numba runs here anyway
        tokenizer_job = None
        try:
            cfg = load_model_config(gf)
            tokenizer_job = _start_tokenizer(gf)
            ops = make_ops(backend, batch_invariant, governor, repack, torch_dtype,
                           kv_cache_type, threads, repack_cache, repack_cache_bytes,
                           torch_graphs)
            kv_budget_bytes = ops.fit_kv_budget(gf, kv_budget_bytes)
            # backends whose attention reads per-layer block tables keep Gemma 3's
            # sliding-window layers in a pool of their own (ForwardBatch.tables_for)
            plan = plan_kv(cfg, kv_budget_bytes, ops.kv_bytes_per_value, block_size,
                           min_kv_tokens, windowed=ops.kv_window_group,
                           max_running_seqs=max_running_seqs,
                           max_tokens_per_step=max_tokens_per_step)
            return cls(gf, cfg, ops, plan, tokenizer_job)
        except BaseException:
            if tokenizer_job is not None:
                tokenizer_job.exception()       # the thread reads the mapping: let it end
            gf.close()          # a failed load keeps no mapping open
            raise

    # -- what the engine reads -------------------------------------------------------------
    @property
    def supports_drafts(self) -> bool:
        """Whether this runner verifies drafts (speculation.py). Only where every verified
        position computes exactly the bits plain decoding of it would, so that speculation
        never changes the output: the CPU backend (rows exact, or made so: forward()). Not
        torch: its matmuls and attention pick kernels by the number of rows (BLAS, cuBLAS,
        SDPA), so a verify row rounds differently from a decode row."""
        return self.ops.exact_drafts

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_job.result()
        return self._tokenizer

    @property
    def weights_format(self) -> str:
        return self.ops.weights_format

    @property
    def kv_bytes(self) -> int:
        return int(self.kv.nbytes)

    @property
    def weights_bytes(self) -> int:
        return self._weights_bytes

    # -- one step --------------------------------------------------------------------------
    def forward(self, spans: Sequence[ScheduledSpan],
                hidden_of: Sequence[ScheduledSpan] = ()) -> np.ndarray:
        """Run the model over the spans; float32 logits [spans that sample, vocab]. The
        final hidden states of every position of the spans in `hidden_of` (embeddings) are
        left in self.hidden as {id(span): float32 [len(span), E]}."""
        self.ops.begin_step()
        self.hidden = {}
        if not spans:
            return np.empty((0, self.cfg.vocab_size), np.float32)
        if not self.ops.rows_exact and any(s.num_draft for s in spans):
            return self._forward_drafts_apart(spans, hidden_of)
        return self._forward(spans, hidden_of)

    def _forward_drafts_apart(self, spans, hidden_of) -> np.ndarray:
        """A step with drafts on ops whose rows are not exact in any batch (CPU matrices not
        repacked): the spans with drafts run in a forward of their own with ops.per_row set,
        so each of their rows is the one-row matvec's bits, the rest as usual; the logits
        come back in the spans' order."""
        drafted = [s for s in spans if s.num_draft]
        rest = [s for s in spans if not s.num_draft]
        self.ops.per_row = True
        try:
            a = self._forward(drafted, ())
        finally:
            self.ops.per_row = False
        b = self._forward(rest, hidden_of) if rest else a[:0]
        parts, ia, ib = [], 0, 0
        for s in spans:
            if not s.sample:
                continue
            n = 1 + s.num_draft
            if s.num_draft:
                parts.append(a[ia:ia + n])
                ia += n
            else:
                parts.append(b[ib:ib + n])
                ib += n
        return np.concatenate(parts) if parts else a[:0]

    @property
    def supports_images(self) -> bool:
        """The model takes embeddings in place of tokens and the backend attends inside an
        image (ForwardBatch.embd_rows / attn_until: every backend's put_rows and attention)."""
        return _forward_owner_says(self.model, "accepts_embeddings")

    def image_encoder(self, mmproj: str) -> None:
        """None: the engine runs the projector's native tower on this backend's ops."""
        return None

    def set_context_length(self, n_ctx: int) -> None:
        self.model.set_context_length(n_ctx, self.gf)

    def _attach_images(self, spans, batch) -> None:
        """The step's image positions: their embeddings, and how far they attend."""
        rows, values, until = [], [], None
        t = 0
        for s in spans:
            n = len(s.token_ids)
            for img in self._images.get(s.req_id, ()):
                lo, hi = max(s.start, img.start), min(s.start + n, img.end)
                if lo >= hi:
                    continue
                r = np.arange(t + lo - s.start, t + hi - s.start, dtype=np.int64)
                rows.append(r)
                values.append(img.embeddings[lo - img.start:hi - img.start])
                if img.bidirectional:
                    if until is None:
                        until = batch.positions.copy()
                    until[r] = img.end - 1
            t += n
        if rows:
            batch.embd_rows = np.concatenate(rows)
            batch.embd_values = np.ascontiguousarray(np.concatenate(values), np.float32)
            batch.token_ids[batch.embd_rows] = 0       # placeholders are not vocabulary ids
            batch.attn_until = until

    def _forward(self, spans, hidden_of) -> np.ndarray:
        batch = build_forward_batch(spans, self.kv_plan.block_size, self.window_layer)
        if self._images:
            self._attach_images(spans, batch)
        self._check_blocks(batch)
        if hidden_of:
            return self._forward_hidden(spans, batch, hidden_of)
        if not len(batch.logits_indices):
            batch.logits_indices = np.array([batch.num_tokens - 1], np.int64)
            self.model.forward(batch, self.kv)
            return np.empty((0, self.cfg.vocab_size), np.float32)
        if self._decode is not None and self._decode.applies(batch):
            logits = self._decode.run(batch)
            if logits is not None:
                return self.ops.to_numpy(logits)
        return self.ops.to_numpy(self.model.forward(batch, self.kv))

    def _check_blocks(self, batch) -> None:
        """Refuse a step whose block tables name blocks outside their pool: the kernels do not
        bounds-check, so such a step would write K/V over unrelated memory."""
        plan = self.kv_plan
        for name, table, n in (("block", batch.block_tables, plan.num_blocks),
                               ("window block", batch.window_tables, plan.window_blocks)):
            if table is not None and table.size and (int(table.max()) >= n or int(table.min()) < 0):
                raise ValueError(f"{name} table entry outside the pool of {n} blocks "
                                 f"(entries {int(table.min())}..{int(table.max())})")

    def _forward_hidden(self, spans, batch, hidden_of) -> np.ndarray:
        want = {id(s) for s in hidden_of}
        rows, where, t, off = [], [], 0, 0
        for s in spans:
            n = len(s.token_ids)
            if id(s) in want:
                where.append((s, off, n))
                rows.append(np.arange(t, t + n, dtype=np.int64))
                off += n
            t += n
        batch.hidden_indices = np.concatenate(rows)
        logits = self.model.forward(batch, self.kv)
        for s, off, n in where:
            self.hidden[id(s)] = batch.hidden[off:off + n]
        if logits is None:
            return np.empty((0, self.cfg.vocab_size), np.float32)
        return self.ops.to_numpy(logits)

    def execute(self, plan: StepPlan) -> StepResult:
        self.sampling.begin(plan)
        self.pooler.begin(plan)
        spans, pooled = self.pooler.split(plan.spans)
        for rid in plan.finished:
            self._prompts.pop(rid, None)
            self._images.pop(rid, None)
        for req in plan.new_requests:
            self._prompts[req.req_id] = req.prompt_token_ids
            if req.images:
                self._images[req.req_id] = req.images
        scored = [s for s in spans if s.prompt_logprobs is not None]
        if scored:
            spans = [s for s in spans if s.prompt_logprobs is None]
        logits = self.forward(spans, pooled)
        sampled = [s for s in spans if s.sample]
        plp = {}
        if scored:     # after the batch: their pieces run one after another (logprobs.py)
            plp, more, more_logits = score_spans(scored, self._prompts, self._logits_rows,
                                                 self.cfg.vocab_size)
            sampled += more
            logits = np.concatenate([logits, more_logits]) if len(logits) else more_logits
        result = self.sampling.sample(sampled, logits)
        result.prompt_logprobs = plp
        for s in pooled:
            vec = self.pooler.add(s, self.hidden[id(s)])
            if vec is not None:
                if result.hidden is None:
                    result.hidden = {}
                if self.pooler.kind(s.req_id) == "rank":
                    vec = self.rank(vec)
                elif self.model.post_pool is not None:
                    vec = self.model.post_pool(vec)     # EmbeddingGemma's dense projections
                result.hidden[s.req_id] = vec
        self.hidden = {}
        return result

    def _logits_rows(self, span: ScheduledSpan, rows) -> np.ndarray:
        """One span alone through the model; float32 logits of the given rows of it."""
        batch = build_forward_batch([span], self.kv_plan.block_size, self.window_layer)
        batch.logits_indices = np.asarray(rows, np.int64)
        return self.ops.to_numpy(self.model.forward(batch, self.kv))

    def rank(self, vec: np.ndarray) -> np.ndarray:
        """The classification head over a rank-pooled vector (rerankers): float32 [classes]."""
        return np.asarray(self.model.rank_head(vec), np.float32).reshape(-1)

    def close(self) -> None:
        """Drop the weights, the KV pool and the file mapping (deterministic unload)."""
        self.ops.release()
        if self._decode is not None:
            self._decode.close()        # its recordings hold the weights and the KV pool
            self._decode = None
        self.model = None
        self.kv = None
        self.sampling = SamplingStage()
        self.gf.close()
