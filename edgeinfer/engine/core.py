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
from typing import Callable

from edgeinfer.formats.chat_template import chat_template_for, encode_prompt, render_chat, special_token_strings
from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.runners.native import make_runner
from edgeinfer.engine.sampling import Sampler, SamplingParams, SeqSamplingState
from edgeinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from edgeinfer.engine.sequence import Sequence
from edgeinfer.engine.stops import StopMatcher, stop_token_set
from edgeinfer.formats.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("edgeinfer.engine.core")


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, bad parameter); a 400 in the API."""


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "cpu"
    max_model_len: int | None = None      # context per sequence; default min(model's, 8192)
    kv_budget_bytes: int | None = None    # default: enough for 4 full contexts, capped at 2 GiB
    max_running_seqs: int = 16
    max_tokens_per_step: int = 512
    block_size: int = 16
    # True: a request's tokens do not depend on what it is batched with (one matmul kernel for
    # every batch size), at about 2.4x the single-stream decode time until a fused small-batch
    # kernel exists. Default: the fast single-row kernel for lone decodes.
    batch_invariant: bool = field(
        default_factory=lambda: os.environ.get("EDGEINFER_BATCH_INVARIANT", "0") == "1")


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


Sink = Callable[[RequestOutput], None]


class _SeqState:
    """Per-sequence engine slot (kept in Sequence.sampling_state)."""

    def __init__(self, engine: "Engine", seq_id: int, prompt: list[int], params: SamplingParams,
                 sink: Sink, choice: int):
        tok = engine.tokenizer
        self.sampling = SeqSamplingState(params, prompt, choice_index=choice,
                                         eos_token_ids=tok.eot_ids)
        self.detok = IncrementalDetokenizer(tok)
        self.stops = StopMatcher(list(params.stop))
        self.stop_ids = stop_token_set(params.stop_token_ids, tok.eot_ids, params.ignore_eos)
        self.sink = sink
        self.out = RequestOutput(seq_id, num_prompt_tokens=len(prompt),
                                 arrival_time=time.monotonic())
        self.want_logprobs = params.logprobs is not None


class Engine:
    def __init__(self, path: str, config: EngineConfig = EngineConfig()):
        self.path = path
        self.config = config
        self.runner = make_runner(path, config.backend,
                                  kv_budget_bytes=self._kv_budget(config),
                                  block_size=config.block_size,
                                  max_running_seqs=config.max_running_seqs,
                                  max_tokens_per_step=config.max_tokens_per_step,
                                  batch_invariant=config.batch_invariant)
        self.cfg: ModelConfig = self.runner.cfg
        md = self.runner.gf.metadata
        # the llama.cpp runner brings its own when our tokenizer cannot read the vocabulary
        self.tokenizer = getattr(self.runner, "tokenizer", None) or Tokenizer.from_gguf(md)
        self.chat_template = chat_template_for(md, self.cfg.arch)
        self._specials = special_token_strings(md)
        self.max_model_len = min(self.cfg.context_length, config.max_model_len or 8192)
        plan = self.runner.plan
        self.scheduler = Scheduler(
            SchedulerConfig(num_blocks=plan.num_blocks, block_size=plan.block_size,
                            max_running_seqs=config.max_running_seqs,
                            max_tokens_per_step=max(config.max_tokens_per_step,
                                                    config.max_running_seqs),
                            max_model_len=self.max_model_len),
            KVCacheManager(plan.num_blocks, plan.block_size))
        self.sampler = Sampler()
        self._ids = itertools.count(1)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0

    # -- sizing ----------------------------------------------------------------------------
    @staticmethod
    def _kv_budget(config: EngineConfig) -> int:
        if config.kv_budget_bytes:
            return config.kv_budget_bytes
        env = os.environ.get("EDGEINFER_KV_BUDGET_MB")
        if env:
            return int(env) << 20
        return 1 << 30

    # -- prompts ---------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           bos_token=self._specials.get("bos_token", ""),
                           eos_token=self._specials.get("eos_token", ""), **extra)

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return encode_prompt(self.tokenizer, self.render(messages, **extra))

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    # -- client side (any thread) ----------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               choice: int = 0) -> int:
        """Queue a request; returns its id. Raises RequestError for what can never run."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"the prompt is {n} tokens, but the context is {self.max_model_len} "
                               f"tokens (leave room for at least one output token)")
        if self.runner.plan.capacity_tokens < n + 1:
            raise RequestError(f"the prompt is {n} tokens, more than the KV cache holds "
                               f"({self.runner.plan.capacity_tokens} tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        try:
            params.validate(self.cfg.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        room = self.max_model_len - n
        if params.max_tokens is None or params.max_tokens > room:
            params = replace(params, max_tokens=room if params.max_tokens is None else
                             min(params.max_tokens, room))
        seq_id = next(self._ids)
        self._commands.put(("add", seq_id, list(prompt_ids), params, sink, choice))
        self._wake.set()
        return seq_id

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="edgeinfer-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

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
                _, seq_id, prompt, params, sink, choice = cmd
                seq = Sequence(seq_id, prompt, params)
                seq.sampling_state = _SeqState(self, seq_id, prompt, params, sink, choice)
                self.scheduler.add(seq)
            elif cmd[0] == "abort":
                self.scheduler.abort(cmd[1])

    def _fail(self, seq: Sequence, message: str) -> None:
        self.scheduler.finish(seq.seq_id, "error")
        st: _SeqState = seq.sampling_state
        self._emit(st, seq, finished=True, reason="error", error=message)

    def _emit(self, st: _SeqState, seq: Sequence, finished: bool = False,
              reason: str | None = None, error: str | None = None) -> None:
        out = st.out
        out.num_output_tokens = seq.num_output_tokens
        out.num_cached_tokens = max(out.num_cached_tokens, seq.num_cached_tokens)
        if finished:
            out.finished, out.finish_reason, out.error = True, reason, error
            out.finish_time = time.monotonic()
        try:
            st.sink(out)
        except Exception:
            log.exception("request sink failed; aborting request %d", seq.seq_id)
            self.scheduler.abort(seq.seq_id)
        st.out = RequestOutput(out.request_id, num_prompt_tokens=out.num_prompt_tokens,
                               num_output_tokens=out.num_output_tokens,
                               num_cached_tokens=out.num_cached_tokens,
                               arrival_time=out.arrival_time, first_token_time=out.first_token_time)

    def step(self) -> SchedulerOutput:
        """Schedule, run and sample one batch; deliver events. Engine thread only."""
        out = self.scheduler.schedule()
        for seq in out.aborted:
            self._emit(seq.sampling_state, seq, finished=True, reason="abort")
        for seq in out.finished:
            self._emit(seq.sampling_state, seq, finished=True, reason=seq.finish_reason or "error",
                       error=seq.error)
        if out.is_empty:
            return out
        logits = self.runner.execute(out.chunks, out.block_copies)
        rows = [c for c in out.chunks if c.needs_logits]
        self.steps += 1
        self.prompt_tokens_computed += sum(len(c.token_ids) for c in out.chunks if not c.is_decode)
        sampled: dict[int, int] = {}
        result = None
        if rows:
            result = self.sampler.sample(logits, [c.seq.sampling_state.sampling for c in rows])
            sampled = {c.seq.seq_id: int(t) for c, t in zip(rows, result.tokens)}
        length_done = {s.seq_id for s in self.scheduler.update(out, sampled)}
        now = time.monotonic()
        for i, c in enumerate(rows):
            seq, st = c.seq, c.seq.sampling_state
            token = sampled[seq.seq_id]
            st.sampling.append(token)
            self.tokens_generated += 1
            o = st.out
            if o.first_token_time is None:
                o.first_token_time = now
            stop = None
            if token in st.stop_ids:
                stop = "stop"
            else:
                text, hit = st.stops.push(st.detok.add(token))
                o.text += text
                o.token_ids.append(token)
                if st.want_logprobs:
                    o.logprobs.append(float(result.logprobs[i]))
                    if result.top_logprobs is not None:
                        o.top_logprobs.append(result.top_logprobs[i])
                if hit:
                    stop = "stop"
            if stop:
                self.scheduler.finish(seq.seq_id, "stop")
                self._emit(st, seq, finished=True, reason="stop")
            elif seq.seq_id in length_done:
                o.text += st.stops.push(st.detok.flush())[0] + st.stops.flush()
                self._emit(st, seq, finished=True, reason="length")
            else:
                self._emit(st, seq)
        return out

    # -- a synchronous helper for scripts and tests -----------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Run one request to completion on the calling thread (the loop must not be running)."""
        events: list[RequestOutput] = []
        self.submit(prompt_ids, params, events.append)
        self._drain_commands()
        while self.scheduler.has_work():
            self.step()
        final = RequestOutput(events[0].request_id if events else 0)
        for e in events:
            final.text += e.text
            final.token_ids += e.token_ids
            final.logprobs += e.logprobs
            final.top_logprobs += e.top_logprobs
        last = events[-1]
        for k in ("finished", "finish_reason", "error", "num_prompt_tokens", "num_output_tokens",
                  "num_cached_tokens", "arrival_time", "first_token_time", "finish_time"):
            setattr(final, k, getattr(last, k))
        return final

    def stats(self) -> dict[str, float]:
        d = self.scheduler.stats().to_dict()
        d.update(steps=self.steps, tokens_generated=self.tokens_generated,
                 prompt_tokens_computed=self.prompt_tokens_computed)
        return d


def greedy(max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


__all__ = ["Engine", "EngineConfig", "RequestOutput", "RequestError", "greedy"]
