"""The llama.cpp runner: our scheduler drives one llama.cpp context holding many sequences.

It implements edgeinfer.runners.base.Runner. llama.cpp keeps its own KV cells, so the
engine's block pool runs without a prefix cache here (`prefix_caching = False`): block ids
are only capacity accounting. What llama.cpp holds is tracked per *slot* (a llama seq id) as
the list of tokens at positions 0..n-1:

- a running request is bound to one slot from its first span until the plan says it
  finished or was preempted;
- a span whose start is below what the slot holds (preemption) is reconciled: the slot's
  tail is removed (seq_rm) and whatever the slot lacks before the span is recomputed;
- a new request gets the free slot sharing the longest prefix with it, or a copy (seq_cp)
  of a longer prefix held by any other slot: llama.cpp's own prefix reuse, reported per
  request in StepResult.reused_tokens, so `cached_tokens` counts what was really skipped.
  Finished requests' slots keep their cells for that until the pool needs room (least
  recently used first).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from edgeinfer.runners.llamacpp.context import LlamaContext, LlamaError
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.formats.kv_cache_types import KV_BYTES_PER_VALUE, check_kv_cache_type
from edgeinfer.formats.model_config import ModelConfig, UnsupportedArchitecture, load_model_config, summarize
from edgeinfer.runners.base import KVPlan, StepPlan, StepResult
from edgeinfer.runners.logprobs import CHUNK_ROWS, PromptLogprobs, rows_logprobs, wanted_positions
from edgeinfer.runners.sampling_stage import SamplingStage

RETAINED_SLOTS = 4   # finished sequences kept for prefix reuse beyond the running ones


@dataclass
class _Slot:
    sid: int
    tokens: list[int] = field(default_factory=list)   # what llama.cpp holds at 0..n-1
    req_id: int | None = None                         # the bound request
    last_used: int = 0


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n and a[:n] == b[:n]:  # the common case: one is a prefix of the other
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _config(gf, ctx: LlamaContext) -> ModelConfig:
    """Our config when the architecture is native; otherwise one filled from llama.cpp."""
    try:
        return load_model_config(gf)
    except UnsupportedArchitecture:
        s = summarize(gf)
        n_head = s.n_head or ctx.model_int("llama_model_n_head")
        n_embd = s.n_embd or ctx.model_int("llama_model_n_embd")
        return ModelConfig(
            arch=s.arch, name=s.name or s.arch, n_layers=s.n_layers or ctx.model_int("llama_model_n_layer"),
            n_embd=n_embd, n_ff=0, n_head=n_head, n_kv_head=s.n_kv_head or n_head,
            head_dim=s.head_dim or n_embd // n_head, vocab_size=ctx.n_vocab,
            context_length=s.context_length or ctx.model_int("llama_model_n_ctx_train"),
            rms_eps=1e-6, rope_base=10000.0, rope_neox=False)


class LlamaCppRunner:
    kind = "llamacpp"
    weights_format = "gguf (llama.cpp)"
    prefix_caching = False
    supports_drafts = False       # llama.cpp gives one row of logits per sampled span here
    # images: libmtmd encodes them (image_encoder), their rows decode non-causally as
    # embeddings (LlamaContext.decode_embd)
    supports_images = True
    pooling = None                # no embeddings through this runner (the native one pools)
    embedding_only = False

    def __init__(self, path: str, kv_budget_bytes: int = 1 << 30, block_size: int = 16,
                 min_kv_tokens: int = 0, max_running_seqs: int = 16, max_tokens_per_step: int = 512,
                 n_threads: int | None = None, governor=None, kv_cache_type: str | None = None):
        kv_cache_type = check_kv_cache_type(kv_cache_type or "f16")
        self.kv_cache_type = kv_cache_type
        self.gf = read_gguf(path)
        meta = summarize(self.gf)
        per_token = round((meta.kv_bytes_per_token_f16 or 2) * KV_BYTES_PER_VALUE[kv_cache_type] / 2)
        tokens = max(kv_budget_bytes // per_token, min_kv_tokens, block_size)
        n_ctx = (tokens // block_size) * block_size
        n_seq = min(max_running_seqs + RETAINED_SLOTS, 256)
        try:
            self.ctx = LlamaContext(path, n_ctx, n_seq, max(512, max_tokens_per_step), n_threads,
                                    kv_cache_type=kv_cache_type)
        except BaseException:
            self.gf.close()
            raise
        self.cfg = _config(self.gf, self.ctx)
        # llama.cpp may round n_ctx up; the scheduler must never promise more than it holds
        self.kv_plan = KVPlan(self.ctx.n_ctx // block_size, block_size, per_token)
        self.slots = [_Slot(i) for i in range(n_seq)]
        self._prompt_len: dict[int, int] = {}    # prompt logprobs score positions below it
        self._clock = itertools.count(1)
        self.tokens_decoded = 0   # rows llama.cpp computed; less than scheduled when reused
        # the process's CPU budget: asked before each step, like the native CPU backend, so
        # llama.cpp and native engines loaded together share the cores
        self.governor = governor
        self.tokenizer = self._tokenizer()
        self.sampling = SamplingStage(self.tokenizer.eot_ids)
        # request id -> its tokens so far (prompt + sampled): what a slot must hold
        self._history: dict[int, list[int]] = {}
        self._images: dict[int, tuple] = {}     # request id -> its prompt's ImageSpans

    @property
    def kv_bytes(self) -> int:
        return self.kv_plan.nbytes

    @property
    def weights_bytes(self) -> int:
        return sum(t.nbytes for t in self.gf.tensors.values())

    @classmethod
    def load(cls, path: str, kv_budget_bytes: int = 1 << 30, block_size: int = 16,
             min_kv_tokens: int = 0, **kw) -> "LlamaCppRunner":
        return cls(str(path), kv_budget_bytes, block_size, min_kv_tokens, **kw)

    def set_context_length(self, n_ctx: int) -> None:
        """Nothing to do: llama.cpp chose its RoPE factors for the context it was given at
        load (LlamaContext)."""

    def image_encoder(self, mmproj: str):
        """libmtmd on this runner's model: a callable RGB pixels -> embeddings."""
        from edgeinfer.runners.llamacpp.mtmd import MtmdEncoder
        return MtmdEncoder(mmproj, self.ctx, self.ctx.n_threads)

    def _tokenizer(self):
        from edgeinfer.formats.tokenizer import Tokenizer
        try:
            return Tokenizer.from_gguf(self.gf.metadata)
        except Exception:  # a vocabulary our tokenizer does not know: llama.cpp's own
            from edgeinfer.runners.llamacpp.tokenizer import LlamaTokenizer
            return LlamaTokenizer(self.ctx, self.gf.metadata)

    # -- slots -----------------------------------------------------------------------------
    def _unbind(self, req_ids) -> None:
        gone = set(req_ids)
        for s in self.slots:
            if s.req_id in gone:
                s.req_id = None

    def _bind(self, req_id: int, target: list[int], committed: dict[int, int]) -> _Slot:
        """The request's slot; a new one starts from the longest prefix any slot holds
        (`committed`: cells each slot really has, before this step's pending rows)."""
        for s in self.slots:
            if s.req_id == req_id:
                return s
        free = [s for s in self.slots if s.req_id is None]
        if not free:
            raise LlamaError("no llama.cpp sequence slot is free (more running sequences than "
                             "n_seq_max)")
        slot = max(free, key=lambda s: (_lcp(s.tokens, target), -s.last_used))
        own = _lcp(slot.tokens, target)
        donor = max(self.slots, key=lambda s: min(_lcp(s.tokens, target), committed[s.sid]))
        shared = min(_lcp(donor.tokens, target), committed[donor.sid])
        if donor is not slot and shared > own:
            self.ctx.seq_rm(slot.sid)
            self.ctx.seq_cp(donor.sid, slot.sid, 0, shared)
            slot.tokens = donor.tokens[:shared]
        slot.req_id = req_id
        return slot

    def _evict_for(self, need: int) -> None:
        """Drop free slots' cells (least recently used first) until `need` more cells fit."""
        held = sum(len(s.tokens) for s in self.slots)   # over-counts shared cells: safe
        for s in sorted((s for s in self.slots if s.req_id is None and s.tokens),
                        key=lambda s: s.last_used):
            if held + need <= self.ctx.n_ctx:
                return
            held -= len(s.tokens)
            self.ctx.seq_rm(s.sid)
            s.tokens = []

    # -- one step --------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: bind slots, decode what they lack, sample."""
        if self.governor is not None:
            self.ctx.set_threads(self.governor.share())
        self.sampling.begin(plan)
        for rid in plan.finished:
            self._history.pop(rid, None)
            self._images.pop(rid, None)
        for req in plan.new_requests:
            self._history[req.req_id] = list(req.prompt_token_ids)
            if req.images:
                self._images[req.req_id] = req.images
            self._prompt_len[req.req_id] = len(req.prompt_token_ids)
        for rid in plan.finished:
            self._prompt_len.pop(rid, None)
        self._unbind(plan.finished)
        self._unbind(plan.preempted)
        plp: dict[int, PromptLogprobs] = {}
        logits, reused = self.forward(plan.spans, plp)
        result = self.sampling.sample([s for s in plan.spans if s.sample], logits)
        for rid, toks in result.tokens.items():
            self._history[rid].extend(toks)
        result.reused_tokens = reused
        result.prompt_logprobs = plp
        return result

    def forward(self, spans, prompt_logprobs: dict | None = None
                ) -> tuple[np.ndarray, dict[int, int]]:
        """Logits [spans that sample, vocab], and per request the prompt tokens this step
        skipped because its slot (or a copied prefix) already held them. Spans that ask for
        prompt logprobs recompute every position (no slot reuse) with logits for each row;
        those rows are reduced into `prompt_logprobs` chunk by chunk (logprobs.py)."""
        rows: list[tuple] = []      # token, pos, seq id, wants logits, (req id, k) when scored
        reused: dict[int, int] = {}
        now = next(self._clock)
        committed = {s.sid: len(s.tokens) for s in self.slots}
        for span in spans:
            end = span.end
            target = self._history[span.req_id][:end]
            if tuple(target[span.start:]) != tuple(span.token_ids):
                raise LlamaError("a span's tokens disagree with its request's history")
            slot = self._bind(span.req_id, target, committed)
            slot.last_used = now
            keep = min(_lcp(slot.tokens, target), end - 1 if span.sample else end)
            scored = span.prompt_logprobs is not None
            if scored:
                keep = min(keep, span.start)
                want = wanted_positions(span.start, end, self._prompt_len[span.req_id])
            if keep < len(slot.tokens):
                if not self.ctx.seq_rm(slot.sid, keep, -1):
                    self.ctx.seq_rm(slot.sid)
                    keep = 0
                slot.tokens = slot.tokens[:keep]
            if keep > span.start:
                reused[span.req_id] = keep - span.start
            # from what the slot holds (below span.start when it lacks part of the prefix)
            images = self._images.get(span.req_id, ())
            for p in range(keep, end):
                last = span.sample and p == end - 1
                if target[p] < 0:       # an image position: its embedding row
                    k = next(i for i, im in enumerate(images) if im.start <= p < im.end)
                    rows.append((target[p], p, slot.sid, False, None, False,
                                 (span.req_id, k, images[k].embeddings[p - images[k].start],
                                  images[k].bidirectional)))
                elif scored and p in want:
                    rows.append((target[p], p, slot.sid, True, (span.req_id, span.prompt_logprobs),
                                 last, None))
                else:
                    rows.append((target[p], p, slot.sid, last, None, last, None))
            slot.tokens = target
        self._evict_for(len(rows))
        self.tokens_decoded += len(rows)
        return self._decode(rows, prompt_logprobs), reused

    def _parts(self, rows: list[tuple]):
        """Decode calls: at most n_batch rows, and at most CHUNK_ROWS rows with logits; the
        rows of one image in a call of their own (decoded non-causally, never cut)."""
        nb, i = self.ctx.n_batch, 0
        while i < len(rows):
            img = rows[i][6]
            if img is not None:
                j = i
                while j < len(rows) and rows[j][6] is not None and rows[j][6][:2] == img[:2]:
                    j += 1
                if j - i > nb:
                    raise LlamaError(f"an image of {j - i} tokens does not fit one llama.cpp "
                                     f"batch of {nb}")
                yield rows[i:j]
                i = j
                continue
            j, wanted = i, 0
            while (j < len(rows) and j - i < nb and rows[j][6] is None
                   and (wanted < CHUNK_ROWS or not rows[j][3])):
                wanted += rows[j][3]
                j += 1
            yield rows[i:j]
            i = j

    def _decode(self, rows: list[tuple], prompt_logprobs: dict | None = None) -> np.ndarray:
        out = []
        for part in self._parts(rows):
            tok, pos, sid, want = (list(x) for x in zip(*(r[:4] for r in part)))
            if part[0][6] is not None:
                rc = self.ctx.decode_embd(np.stack([r[6][2] for r in part]), pos, sid[0],
                                          want_last=False, causal=not part[0][6][3])
            else:
                rc = self.ctx.decode(tok, pos, sid, want)
            if rc != 0:
                for s in self.slots:  # state is unknown now: recompute from scratch next time
                    self.ctx.seq_rm(s.sid)
                    s.tokens = []
                raise LlamaError(f"llama_decode failed with status {rc} (KV cache of "
                                 f"{self.ctx.n_ctx} tokens full?)")
            scored: dict[int, list] = {}
            for j, r in enumerate(part):
                if r[4] is not None:
                    scored.setdefault(r[4][0], [r[4][1]]).append((j, r[1]))
                if r[5]:
                    out.append(self.ctx.logits(j))
            for rid, (k, *js) in scored.items():
                prompt = self._history[rid]        # starts with the prompt
                lg = np.stack([self.ctx.logits(j) for j, _ in js])
                lp, top = rows_logprobs(lg, np.asarray([prompt[p + 1] for _, p in js]), k)
                chunk = PromptLogprobs(js[0][1] + 1, lp, top)
                if rid in prompt_logprobs:
                    prompt_logprobs[rid].extend(chunk)
                else:
                    prompt_logprobs[rid] = chunk
        if not out:
            return np.empty((0, self.ctx.n_vocab), np.float32)
        return np.stack(out).astype(np.float32, copy=False)

    def close(self) -> None:
        self.ctx.close()
        self.gf.close()
        self._history.clear()
