"""The engine: one thread that owns the scheduler, the runner and the sampler.

Clients (the CLI, the HTTP server) call `submit()` and `abort()` from any thread; those only
enqueue commands. The engine thread drains the commands, schedules one step, runs it, samples,
detokenizes, applies stop conditions, and hands `RequestOutput` events to each request's sink
(a callable; the API layer forwards them to its asyncio queue thread-safely).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from edgeinfer.engine import heap
from edgeinfer.engine.constraint import ConstraintError, TokenConstraint
from edgeinfer.engine.images import load_vision
from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.engine.prompt_scoring import PromptScoring
from edgeinfer.engine.prompts import PromptMethods, Prompter, chat_format
from edgeinfer.engine.requests import (EngineInfo, RequestError, check_embed, check_request,
                                       no_images_note)
from edgeinfer.engine.repetition import RepetitionGuard
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from edgeinfer.engine.sequence import Sequence
from edgeinfer.engine.speculation import (MAX_BATCH, WINDOW as SPEC_WINDOW,
                                           SpeculationStats, propose)
from edgeinfer.engine.stops import FinishCheck, stop_token_set
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.formats.tokenizer import IncrementalDetokenizer
from edgeinfer.runners.base import NewRequest, Runner, ScheduledSpan, StepPlan
from edgeinfer.runners.load import load_runner

log = logging.getLogger("edgeinfer.engine.core")


DEFAULT_KV_BUDGET = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings: the edge (CLI, daemon) builds it from its Settings
    (from_settings) and passes it down; nothing below reads the environment."""
    backend: str = "cpu"
    max_model_len: int | None = None      # context per sequence; default min(model's, 8192)
    kv_budget_bytes: int | None = None    # KV pool budget; default DEFAULT_KV_BUDGET
    kv_cache_type: str | None = None      # "f16" or "q8_0"; None: the backend's default (f16)
    max_running_seqs: int = 16
    max_tokens_per_step: int = 512
    block_size: int = 16
    # True: every row through one matmul kernel whatever the batch size, so a request's
    # tokens never depend on its batch. The repacked int8 path (AVX2+ CPUs) is invariant
    # either way; this only matters for the float/quantized-block kernels.
    batch_invariant: bool = False
    repack: bool | None = None            # CPU weights as int8 tiles; None = per model
    torch_dtype: str | None = None        # torch weights' dtype; None = the device's choice
    torch_graphs: bool = True             # torch on CUDA: decode steps as CUDA graphs
    threads: int | None = None            # a fixed CPU thread count (None: measured per step)
    speculative: bool = True              # prompt-lookup drafts for small batches
    repack_cache: str | None = None       # a directory for repacked CPU weights; None: off
    repack_cache_bytes: int = 0           # at most this much there
    governor: Any = field(default=None, compare=False)   # the process's CPU thread budget

    @classmethod
    def from_settings(cls, settings, backend: str | None = None, governor=None,
                      **kw) -> "EngineConfig":
        """The config an edgeinfer.settings.Settings gives one engine (`backend`: the
        resolved name; `kw` overrides, e.g. a request's kv_cache_type load option)."""
        kw.setdefault("kv_cache_type", settings.kv_cache_type)
        kw.setdefault("max_model_len", settings.max_model_len)
        return cls(backend=backend or settings.backend, kv_budget_bytes=settings.kv_budget_bytes,
                   max_running_seqs=settings.max_running_seqs,
                   batch_invariant=settings.batch_invariant, repack=settings.repack,
                   torch_dtype=settings.torch_dtype, torch_graphs=settings.torch_graphs,
                   threads=settings.threads,
                   speculative=settings.speculative, repack_cache=settings.repack_cache,
                   repack_cache_bytes=settings.repack_cache_bytes, governor=governor, **kw)


@dataclass
class RequestOutput:
    """What a request's sink receives after each step that touched it."""
    request_id: int
    text: str = ""                          # new text since the previous event
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None        # stop | length | abort | error
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # embedding requests: the pooled vector (raw, not normalized), in the finished event
    embedding: Any = None
    # prompt logprobs when asked (submit(prompt_logprobs=k)): entry p is log P(prompt[p] |
    # prompt[:p]) (None at p = 0) and its k best alternatives; once, complete, in the first
    # event after the prompt is computed
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


Sink = Callable[[RequestOutput], None]


class _RequestState:
    """The engine's per-request slot: where events go and how the request finishes. (The
    token history is the Sequence's; sampling state lives on the runner's side.)"""

    def __init__(self, engine: "Engine", seq_id: int, prompt: list[int], params: SamplingParams,
                 sink: Sink, choice: int, constraint: TokenConstraint | None):
        tok = engine.tokenizer
        self.choice = choice
        self.constraint = constraint
        self.finish = FinishCheck(
            IncrementalDetokenizer(tok), params.stop,
            stop_token_set(params.stop_token_ids, tok.eot_ids, params.ignore_eos),
            max_tokens=int(params.max_tokens), max_model_len=engine.max_model_len,
            constraint=constraint,
            # not under a grammar: a cut there would hand back output that does not parse
            repetition=(RepetitionGuard() if params.stop_on_repetition and constraint is None
                        else None))
        self.sink = sink
        self.out = RequestOutput(seq_id, num_prompt_tokens=len(prompt),
                                 arrival_time=time.monotonic())
        self.want_logprobs = params.logprobs is not None
        self.reused = 0       # prompt tokens the runner's own cache skipped (llama.cpp)
        self.spec = SpeculationStats()
        self.prediction: np.ndarray | None = None     # Predicted Outputs: a draft source
        self.pooling: str | None = None     # embedding requests: how the runner pools
        self.scoring: PromptScoring | None = None   # prompt logprobs / max_tokens 0
        self.images: tuple = ()             # the prompt's ImageSpans


class Engine(PromptMethods):
    def __init__(self, path: str, config: EngineConfig = EngineConfig(),
                 mmproj: str | None = None):
        """`mmproj`: a vision projector for the model (edgeinfer.engine.images); a file that
        does not match the model fails the load, nothing half-loaded."""
        self.path = path
        self.config = config
        self.vision = None
        self.dead: str | None = None    # never set in process: RemoteEngine's process can die
        self.vision_note = ""       # why a model with a projector takes no images here
        self.runner: Runner = load_runner(
            path, config.backend, kv_budget_bytes=config.kv_budget_bytes or DEFAULT_KV_BUDGET,
            block_size=config.block_size, max_running_seqs=config.max_running_seqs,
            max_tokens_per_step=config.max_tokens_per_step,
            batch_invariant=config.batch_invariant, governor=config.governor,
            n_threads=config.threads, repack=config.repack, torch_dtype=config.torch_dtype,
            torch_graphs=config.torch_graphs,
            kv_cache_type=config.kv_cache_type, repack_cache=config.repack_cache,
            repack_cache_bytes=config.repack_cache_bytes)
        # after the weights, which stay mappings of their own: each step's large temporaries
        # then reuse the last step's pages instead of faulting in fresh ones (heap.py)
        heap.recycle_large_blocks()
        try:
            self.cfg: ModelConfig = self.runner.cfg
            md = self.runner.gf.metadata
            self.tokenizer = self.runner.tokenizer
            self.max_model_len = min(self.cfg.context_length, config.max_model_len or 8192)
            # phi3: LongRoPE factors chosen by the context, as llama.cpp
            self.runner.set_context_length(self.max_model_len)
            if mmproj and not self.runner.supports_images:
                # text still works; image requests get this reason
                self.vision_note = (f"the {self.cfg.arch} architecture does not take image "
                                    f"embeddings on the {self.runner.kind} backend yet (try "
                                    f"backend llamacpp)")
            elif mmproj:
                self.vision = load_vision(self.runner, self.tokenizer, mmproj,
                                          config.backend)
            self.vision_note = self.vision_note or no_images_note(self.cfg.name)
            self.prompts = Prompter(
                self.tokenizer, chat_format(md, self.cfg.arch),
                layout=self.vision.layout if self.vision is not None else None,
                encode_image=self.vision.encode if self.vision is not None else None,
                no_images=self.vision_note)
            plan = self.runner.kv_plan
            self.info = EngineInfo(
                cfg=self.cfg, kind=self.runner.kind,
                weights_format=self.runner.weights_format,
                weights_bytes=int(self.runner.weights_bytes) + (
                    self.vision.nbytes if self.vision is not None else 0),
                kv_bytes=int(self.runner.kv_bytes),
                kv_bytes_per_token=int(plan.bytes_per_token), kv_window=int(plan.window),
                max_model_len=self.max_model_len, capacity_tokens=int(plan.capacity_tokens),
                pooling=self.runner.pooling, embedding_only=bool(self.runner.embedding_only),
                vision=self.vision is not None, vision_note=self.vision_note)
            # the runner says what its block ids mean: shared prefix blocks (native) or only
            # capacity accounting over a cache that reuses prefixes itself (llama.cpp)
            kv = KVCacheManager(plan.num_blocks, plan.block_size,
                                enable_prefix_cache=self.runner.prefix_caching,
                                window=plan.window, window_blocks=plan.window_blocks)
            self.scheduler = Scheduler(
                SchedulerConfig(num_blocks=plan.num_blocks, block_size=plan.block_size,
                                max_running_seqs=config.max_running_seqs,
                                max_tokens_per_step=max(config.max_tokens_per_step,
                                                        config.max_running_seqs),
                                max_model_len=self.max_model_len),
                kv)
        except BaseException:
            if self.vision is not None:
                self.vision.close()
            self.runner.close()
            raise
        self._ids = itertools.count(1)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._states: dict[int, _RequestState] = {}     # engine-thread only
        self._announced: set[int] = set()              # ids the runner has state for
        self._gone: list[int] = []                     # announced ids finished since the last plan
        self._followers: dict[int, list[tuple]] = {}   # leader id -> deferred "add" commands
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self._snapshot: dict[str, float] = self._make_snapshot()
        # called with each new snapshot on the engine thread (the engine process forwards it)
        self.on_publish: Callable[[dict], None] | None = None

    @property
    def pid(self) -> int:
        """The process the engine runs in (this one)."""
        return os.getpid()

    def vision_stats(self) -> dict | None:
        """The projector's counters (images encoded, cache hits, seconds), or None."""
        return self.vision.stats() if self.vision is not None else None

    # -- client side (any thread) ----------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               choice: int = 0, constraint: TokenConstraint | None = None,
               follows: int | None = None, prompt_logprobs: int | None = None,
               score_only: bool = False, prediction: list[int] | None = None,
               images: list | None = None) -> int:
        """Queue a request; returns its id. Raises RequestError for what can never run.

        `prompt_logprobs = k`: the request's events carry its prompt tokens' logprobs and k
        alternatives (RequestOutput.prompt_logprobs). `score_only`: compute the prompt and
        end with reason "length", sampling nothing (OpenAI max_tokens 0).

        `follows`: the id of a request with the same prompt (choice 0 of an n > 1 request).
        This one waits until that one's prompt is computed, then finds it in the prefix
        cache, so n choices share one prefill. `constraint` restricts every sampled token
        (structured output); the request stops when it is complete. `prediction`: tokens the
        output is expected to repeat (OpenAI's Predicted Outputs); speculative drafts are
        looked up in them too, which changes speed, never the output. `images`: the
        ImageSpans of a prompt from encode_chat_images."""
        images = tuple(images or ())
        params, scoring, pred = check_request(self.info, prompt_ids, params, images,
                                              prompt_logprobs, score_only, prediction)
        seq_id = next(self._ids)
        self._commands.put(("add", seq_id, list(prompt_ids), params, sink, choice, constraint,
                            follows, scoring, pred, images))
        self._wake.set()
        return seq_id

    @property
    def pooling(self) -> str | None:
        """How this model pools embeddings (GGUF pooling_type; mean for decoders without
        one); None when its runner cannot embed."""
        return self.info.pooling

    @property
    def max_embed_tokens(self) -> int:
        return self.info.max_embed_tokens

    def submit_embed(self, prompt_ids: list[int], sink: Sink, pooling: str | None = None) -> int:
        """Queue a prefill-only request whose finished event carries the pooled final hidden
        states (RequestOutput.embedding). It batches with everything else, never takes a
        prefix-cache hit (pooling needs every position computed) and ends after its prompt."""
        check_embed(self.info, prompt_ids)
        pooling = pooling or self.pooling
        seq_id = next(self._ids)
        self._commands.put(("embed", seq_id, list(prompt_ids), pooling, sink))
        self._wake.set()
        return seq_id

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def snapshot(self) -> dict[str, float]:
        """Engine figures as of the last step, published by the engine thread (any thread
        may read it; it is replaced, never changed)."""
        return self._snapshot

    # -- the loop --------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="edgeinfer-engine", daemon=True)
            self._thread.start()
        return self

    def run_loop(self) -> None:
        """The engine loop on the calling thread (start() gives it a thread of its own), until
        stop(). For a process whose main thread loaded the model (see remote._EngineServer)."""
        self._loop()

    def stop(self) -> None:
        """End the loop (start()'s or run_loop()'s) after its current step."""
        self._stop.set()
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the engine thread; requests still live end with finish reason "abort"."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._drain_commands()
        for seq in self.scheduler.live_sequences():
            self.scheduler.finish(seq.seq_id, "abort")
            self._end(seq, "abort")
        for deferred in self._followers.values():
            for cmd in deferred:
                self._abort_unstarted(cmd)
        self._followers.clear()

    def close(self) -> None:
        """Shut down and release the runner: weights, KV pool and the file mapping."""
        self.shutdown()
        self._states.clear()
        if self.vision is not None:
            self.vision.close()
        self.runner.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a bug must not kill the daemon: fail the step's requests
                log.exception("engine step failed")
                for seq in list(self.scheduler.live_sequences()):
                    self._fail(seq, f"internal error: {type(e).__name__}: {e}")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                follows = cmd[7]
                if follows is not None and (follows in self._states
                                            or follows in self._followers):
                    self._followers.setdefault(follows, []).append(cmd)
                else:
                    self._add(cmd)
            elif cmd[0] == "embed":
                self._add_embed(cmd)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if not self.scheduler.abort(rid):
                    for deferred in self._followers.values():
                        for c in [c for c in deferred if c[1] == rid]:
                            deferred.remove(c)
                            self._abort_unstarted(c)

    def _add(self, cmd: tuple) -> None:
        _, seq_id, prompt, params, sink, choice, constraint, _, scoring, prediction, images = cmd
        seq = Sequence(seq_id, prompt, params)
        seq.image_spans = [(im.start, im.end) for im in images]
        self._states[seq_id] = _RequestState(self, seq_id, prompt, params, sink, choice,
                                             constraint)
        self._states[seq_id].prediction = prediction
        self._states[seq_id].images = images
        if scoring is not None:
            self._states[seq_id].scoring = scoring
            seq.reuse_prefix = not scoring.wants   # every position's logits are needed
        self.scheduler.add(seq)
        self._followers.setdefault(seq_id, [])

    def _add_embed(self, cmd: tuple) -> None:
        _, seq_id, prompt, pooling, sink = cmd
        params = SamplingParams(temperature=0.0, max_tokens=1)    # never sampled
        seq = Sequence(seq_id, prompt, params)
        seq.reuse_prefix = False         # pooling needs every position's hidden state
        st = _RequestState(self, seq_id, prompt, params, sink, 0, None)
        st.pooling = pooling
        self._states[seq_id] = st
        self.scheduler.add(seq)

    def _abort_unstarted(self, cmd: tuple) -> None:
        _, seq_id, prompt, _, sink, *_ = cmd
        out = RequestOutput(seq_id, finished=True, finish_reason="abort",
                            num_prompt_tokens=len(prompt), arrival_time=time.monotonic(),
                            finish_time=time.monotonic())
        try:
            sink(out)
        except Exception:
            log.exception("request sink failed")

    def _release_followers(self, leader: int) -> None:
        for cmd in self._followers.pop(leader, []):
            self._add(cmd)

    # -- events ----------------------------------------------------------------------------
    def _fail(self, seq: Sequence, message: str) -> None:
        self.scheduler.finish(seq.seq_id, "error")
        self._end(seq, "error", message)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """A request left the scheduler: tell its client, forget it, tell the runner."""
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self._emit(st, seq, finished=True, reason=reason, error=error)
        if seq.seq_id in self._announced:
            self._announced.discard(seq.seq_id)
            self._gone.append(seq.seq_id)
        self._release_followers(seq.seq_id)

    def _emit(self, st: "_RequestState", seq: Sequence, finished: bool = False,
              reason: str | None = None, error: str | None = None) -> None:
        out = st.out
        out.num_output_tokens = 0 if st.scoring and st.scoring.score_only else seq.num_output_tokens
        out.num_cached_tokens = max(out.num_cached_tokens, seq.num_cached_tokens + st.reused)
        if finished:
            out.finished, out.finish_reason, out.error = True, reason, error
            out.finish_time = time.monotonic()
        try:
            st.sink(out)
        except Exception:
            log.exception("request sink failed; aborting request %d", seq.seq_id)
            if not finished:
                self.scheduler.abort(seq.seq_id)
        st.out = RequestOutput(out.request_id, num_prompt_tokens=out.num_prompt_tokens,
                               num_output_tokens=out.num_output_tokens,
                               num_cached_tokens=out.num_cached_tokens,
                               arrival_time=out.arrival_time, first_token_time=out.first_token_time)

    # -- one step --------------------------------------------------------------------------
    def _plan(self, out: SchedulerOutput) -> StepPlan:
        """The scheduler's decisions as plain data for the runner."""
        spans, new = [], []
        for c in out.chunks:
            seq = c.seq
            rid = seq.seq_id
            st = self._states[rid]
            if rid not in self._announced:
                self._announced.add(rid)
                new.append(NewRequest(rid, tuple(seq.prompt_token_ids), seq.params, st.choice,
                                      pooling=st.pooling, images=st.images))
            mask = None
            if c.needs_logits and st.constraint is not None:
                mask = st.constraint.allowed_tokens()
            spans.append(ScheduledSpan(rid, c.start, tuple(c.token_ids), tuple(seq.block_table),
                                       c.needs_logits and st.pooling is None, mask,
                                       st.scoring.k if st.scoring and st.scoring.wants else None,
                                       num_draft=c.num_draft,
                                       window_table=tuple(seq.window_table)))
        gone, self._gone = self._gone, []
        return StepPlan(tuple(spans), tuple(new),
                        preempted=tuple(s.seq_id for s in out.preempted),
                        finished=tuple(gone))

    def _drafts(self) -> dict[int, list[int]]:
        """Prompt-lookup drafts for the decoding sequences of a small batch (speculation.py)."""
        if not self.config.speculative or not self.runner.supports_drafts:
            return {}
        decoding = [s for s in self.scheduler.running if not s.is_prefilling]
        if not decoding or len(decoding) > MAX_BATCH:
            return {}
        drafts = {}
        for seq in decoding:
            st = self._states.get(seq.seq_id)
            if (st is None or st.constraint is not None or st.pooling is not None
                    or st.scoring is not None or not st.spec.worth_it()):
                continue
            # only the lookup window becomes an array: the whole history would cost
            # O(context) every step
            draft = propose(np.asarray(seq.token_ids[-SPEC_WINDOW:], np.int64),
                            st.spec.next_k, st.prediction)
            if draft and min(draft) < 0:    # never an image placeholder as a guess
                draft = draft[:[t < 0 for t in draft].index(True)]
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

    def step(self) -> SchedulerOutput:
        """Schedule, run and sample one batch; deliver events. Engine thread only."""
        out = self.scheduler.schedule(self._drafts())
        for seq in out.aborted:
            self._end(seq, "abort")
        for seq in out.finished:
            self._end(seq, seq.finish_reason or "error", seq.error)
        if not out.is_empty:
            result = self.runner.execute(self._plan(out))
            self.steps += 1
            self.prompt_tokens_computed += sum(len(c.token_ids) for c in out.chunks
                                               if not c.is_decode)
            self._take_side_results(result)
            kept, verdicts = self._check_finishes(out, result)
            for c in out.chunks:            # a grammar that rejected its own sample: that
                verdict = verdicts.get(c.seq.seq_id)     # request fails, the step goes on
                if verdict is not None and verdict[0] == "error":
                    self._fail(c.seq, verdict[1])
            self.scheduler.update(out, kept)
            self._deliver(out, result, kept, verdicts)
        self._publish()
        return out

    def _take_side_results(self, result) -> None:
        """What a step computes besides sampled tokens: tokens a runner's own cache reused,
        embeddings (their requests end now, before their blocks would be published), prompt
        logprobs, and per-request errors."""
        for rid, n in result.reused_tokens.items():
            if rid in self._states:
                self._states[rid].reused = max(self._states[rid].reused, n)
        for rid, vec in (result.hidden or {}).items():
            seq, st = self.scheduler.get(rid), self._states.get(rid)
            if seq is not None and st is not None:
                st.out.embedding = vec
                self.scheduler.finish(rid, "stop")
                self._end(seq, "stop")
        for rid, plp in result.prompt_logprobs.items():
            st = self._states.get(rid)
            if st is not None and st.scoring is not None:
                st.scoring.add(plp)
        for rid, message in result.errors.items():
            seq = self.scheduler.get(rid)
            if seq is not None:
                self._fail(seq, message)

    def _check_finishes(self, out: SchedulerOutput, result) -> tuple[dict, dict]:
        """Each sampling request's new tokens (several when a draft was accepted) through its
        FinishCheck: a stop inside them keeps only the tokens up to it. Returns the tokens
        kept and a verdict per request: ("ok", text, shown indices, reason or None),
        ("score_only",) or ("error", message)."""
        kept: dict[int, list[int]] = {}
        verdicts: dict[int, tuple] = {}
        for c in out.chunks:
            seq = c.seq
            rid = seq.seq_id
            tokens = result.tokens.get(rid)
            if not c.needs_logits or not tokens or rid not in self._states:
                continue
            st = self._states[rid]
            if c.num_draft:
                st.spec.record(c.num_draft, len(tokens) - 1)
            if st.scoring is not None and st.scoring.score_only:
                kept[rid] = tokens[:1]
                verdicts[rid] = ("score_only",)
                continue
            text, shown, reason = "", [], None
            try:
                for i, token in enumerate(tokens):
                    piece, show, reason = st.finish.push(
                        token, seq.num_output_tokens + i + 1, seq.num_tokens + i + 1)
                    text += piece
                    if show:
                        shown.append(i)
                    if reason:
                        break
            except ConstraintError as e:
                verdicts[rid] = ("error", f"structured output: {e}")
                continue
            kept[rid] = tokens[:i + 1]
            verdicts[rid] = ("ok", text, shown, reason)
        return kept, verdicts

    def _deliver(self, out: SchedulerOutput, result, kept: dict, verdicts: dict) -> None:
        """The step's events: new text, tokens and logprobs; the requests that finished end."""
        now = time.monotonic()
        for c in out.chunks:
            seq = c.seq
            rid = seq.seq_id
            verdict = verdicts.get(rid)
            if not c.needs_logits or verdict is None or rid not in self._states:
                continue
            st = self._states[rid]
            o = st.out
            if st.scoring is not None:
                taken = st.scoring.take()
                if taken is not None:
                    o.prompt_logprobs, o.prompt_top_logprobs = taken
                if verdict[0] == "score_only":          # max_tokens 0: the prompt alone
                    self.scheduler.finish(rid, "length")
                    self._end(seq, "length")
                    continue
            _, text, shown, reason = verdict
            tokens = kept[rid]
            self.tokens_generated += len(tokens)
            if o.first_token_time is None:
                o.first_token_time = now
                self._release_followers(rid)       # its prompt is in the prefix cache now
            o.text += text
            lps = result.logprobs.get(rid) if st.want_logprobs else None
            tops = result.top_logprobs.get(rid)
            for i in shown:
                o.token_ids.append(tokens[i])
                if lps is not None and i < len(lps):
                    o.logprobs.append(lps[i])
                    if tops is not None and i < len(tops):
                        o.top_logprobs.append(tops[i])
            if reason:
                self.scheduler.finish(rid, reason)
                self._end(seq, reason)
            else:
                self._emit(st, seq)

    # -- figures ---------------------------------------------------------------------------
    def _make_snapshot(self) -> dict[str, float]:
        d = self.scheduler.stats().to_dict()
        d.update(steps=self.steps, tokens_generated=self.tokens_generated,
                 prompt_tokens_computed=self.prompt_tokens_computed)
        if self.vision is not None:     # for an engine process's daemon (vision_stats)
            d["vision"] = self.vision.stats()
        gov = self.config.governor
        if gov is not None:             # the CPU budget this engine steps with
            d.update(cpu_threads=gov.threads, engine_stepping=int(gov.active_threads() > 0),
                     other_programs_cores=round(float(gov.others), 2))
        return d

    def _publish(self) -> None:
        self._snapshot = self._make_snapshot()
        if self.on_publish is not None:
            self.on_publish(self._snapshot)

    def stats(self) -> dict[str, float]:
        """Engine-thread view (or a stopped engine's); other threads read snapshot()."""
        return self._make_snapshot()

    # -- a synchronous helper for scripts and tests -----------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 constraint: TokenConstraint | None = None,
                 images: list | None = None) -> RequestOutput:
        """Run one request to completion on the calling thread (the loop must not be running)."""
        events: list[RequestOutput] = []
        self.submit(prompt_ids, params, events.append, constraint=constraint, images=images)
        self._drain_commands()
        while self.scheduler.has_work():
            self.step()
        final = RequestOutput(events[0].request_id if events else 0)
        for e in events:
            final.text += e.text
            final.token_ids += e.token_ids
            final.logprobs += e.logprobs
            final.top_logprobs += e.top_logprobs
            if e.prompt_logprobs is not None:
                final.prompt_logprobs = e.prompt_logprobs
                final.prompt_top_logprobs = e.prompt_top_logprobs
        last = events[-1]
        for k in ("finished", "finish_reason", "error", "num_prompt_tokens", "num_output_tokens",
                  "num_cached_tokens", "arrival_time", "first_token_time", "finish_time"):
            setattr(final, k, getattr(last, k))
        return final


def embed_all(engine: Engine, prompts: list[list[int]], pooling: str | None = None) -> list:
    """Embed many prompts together on the calling thread (the loop must not be running):
    they batch in the scheduler like any requests. Returns the finished RequestOutputs in
    order (each .embedding raw, not normalized)."""
    outs: dict[int, RequestOutput] = {}
    ids = [engine.submit_embed(p, lambda o: outs.__setitem__(o.request_id, o), pooling)
           for p in prompts]
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    return [outs[i] for i in ids]


def greedy(max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


__all__ = ["Engine", "EngineConfig", "RequestOutput", "RequestError", "greedy"]
