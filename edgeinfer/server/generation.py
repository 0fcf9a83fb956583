"""One API request's life in the engine, shared by both APIs.

`run()` submits the n choices (choice=0..n-1: the prefix cache shares the prompt blocks),
receives the engine thread's RequestOutput events through an asyncio queue
(`call_soon_threadsafe`), and yields them. Whatever ends the iteration early (the client
disconnects, the handler is cancelled, an error) aborts every unfinished choice in the
engine, so its KV blocks are freed on the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi.responses import StreamingResponse

from edgeinfer.engine.core import RequestError, RequestOutput
from edgeinfer.runners.base import start_thread
from edgeinfer.runners.sampling_params import (DRY_BREAKERS, SamplingParams, base_model_params,
                                              breaker_ids, is_base_model, with_vocabulary)

from .errors import APIError
from .metrics import Metrics
from .model_manager import LoadedModel, ModelManager

Disconnected = Callable[[], Awaitable[bool]]
T = TypeVar("T")


class ClientGone(Exception):
    pass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    load_duration: float = 0.0
    arrival: float = 0.0                # monotonic
    first_token: float | None = None
    finish: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)


def params_or_400(**kw) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        param = msg.split(" ", 1)[0] if msg else None
        raise APIError(400, msg, param=param, code="invalid_parameter") from None


_AHEAD: "weakref.WeakSet[Any]" = weakref.WeakSet()    # tokenizers whose pass has begun


def _breakers_ahead(tokenizer) -> None:
    """DRY's default sequence breakers of a model's vocabulary, found on a thread of their
    own once its first request is in the engine (a later request asking for DRY then finds
    them): not at the load, where the pass (~0.1 s for 151k tokens, holding the GIL) made
    the first request's template and tokenizer wait."""
    if not hasattr(tokenizer, "piece_table") or tokenizer in _AHEAD:
        return
    _AHEAD.add(tokenizer)
    start_thread(breaker_ids, tokenizer, DRY_BREAKERS, name="edgeinfer-breakers")


class Generation:
    """Holds a model for one request. `submit()` queues the n choices (bad input raises
    APIError before any response starts); `events()` yields (choice, RequestOutput);
    `release()` aborts whatever is unfinished and gives the model back (idempotent)."""

    def __init__(self, manager: ModelManager, metrics: Metrics, lm: LoadedModel,
                 load_duration: float, n: int):
        self.manager, self.metrics, self.lm, self.n = manager, metrics, lm, n
        self.usage = Usage(load_duration=load_duration, arrival=time.monotonic())
        self._released = False
        self._ids: list[int] = []
        self._done: set[int] = set()
        self._q: asyncio.Queue = asyncio.Queue()
        self.stop_on_repetition = False

    def adapt(self, params: SamplingParams, given: Collection[str] = (),
              stop_on_repetition: bool | None = None) -> SamplingParams:
        """The model's defaults for what the request did not set (`given`: SamplingParams
        names it set). A base model gets DRY and an output cap, and its output stops with
        reason "repetition" once it copies itself (unless stop_on_repetition says)."""
        base = is_base_model(self.lm.engine)
        self.stop_on_repetition = base if stop_on_repetition is None else stop_on_repetition
        return base_model_params(params, given) if base else params

    @contextlib.contextmanager
    def held(self, streaming: bool):
        """A handler's body: an error releases the model at once; a complete answer
        releases it on the way out, a streaming one when its stream ends (events())."""
        try:
            yield self
        except BaseException:
            self.release()
            raise
        if not streaming:
            self.release()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        for i, rid in enumerate(self._ids):
            if i not in self._done:          # the engine's abort event finds no reader
                self.lm.engine.abort(rid)
                self.metrics.on_abort(self.lm.name)
        self.manager.release(self.lm, self.n)

    async def encode(self, build: Callable[..., "T"]) -> "T":
        """`build(engine)` (chat-template rendering, tokenization) on a worker thread: a
        100 KB prompt takes the tokenizer most of a second, and on the event loop that time
        would stall every other stream. Exceptions (ChatTemplateError, APIError) pass through.
        The first request of a base model, whose defaults turn DRY on, also finds DRY's
        default sequence breakers in its vocabulary there (one pass, ~0.1 s for 262k tokens;
        cached after). A chat model's first request does not wait for them: only a request
        that asks for DRY needs them, and submit finds them (the pass ahead began with the
        model's first request; if not done, it is made there, once per model), except with
        a vocabulary asked token by token over a pipe (llama.cpp's: seconds), found here."""
        def work(engine):
            out = build(engine)
            tok = getattr(engine, "tokenizer", None)
            if tok is not None and hasattr(tok, "piece") and (
                    is_base_model(engine) or not hasattr(tok, "piece_table")):
                breaker_ids(tok, DRY_BREAKERS)
            return out
        return await asyncio.to_thread(work, self.lm.engine)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               prompt_param: str = "messages", constraints: list | None = None,
               prompt_logprobs: int | None = None, score_only: bool = False,
               prediction: list[int] | None = None, images: list | None = None) -> None:
        """`constraints`: one TokenConstraint per choice (structured output), or None.
        `prompt_logprobs`: choice 0 reports its prompt's logprobs (the prompt is the same
        for all); `score_only`: compute the prompt, sample nothing (max_tokens 0)."""
        engine = self.lm.engine
        params = with_vocabulary(params, engine.tokenizer)     # DRY's sequence breakers
        # the engine's FinishCheck stops a choice that copies itself, token by token (not
        # under a grammar: a cut there would hand back output that does not parse)
        if self.stop_on_repetition != params.stop_on_repetition:
            params = dataclasses.replace(params, stop_on_repetition=self.stop_on_repetition)
        try:
            params.validate(engine.cfg.vocab_size)   # token ids in logit_bias and friends
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, param=msg.split(" ", 1)[0],
                           code="invalid_parameter") from None
        loop, q = asyncio.get_running_loop(), self._q
        try:
            for i in range(self.n):
                def sink(out: RequestOutput, i: int = i) -> None:
                    loop.call_soon_threadsafe(q.put_nowait, (i, out))
                kw = {"constraint": constraints[i]} if constraints is not None else {}
                if prompt_logprobs is not None and i == 0:
                    kw["prompt_logprobs"] = prompt_logprobs
                if score_only:
                    kw["score_only"] = True
                if prediction:
                    kw["prediction"] = prediction
                if images:
                    kw["images"] = images
                # choices after the first wait for its prefill and share it (prefix cache)
                self._ids.append(engine.submit(prompt_ids, params, sink, choice=i,
                                               follows=self._ids[0] if i else None, **kw))
        except RequestError as e:
            raise APIError(400, str(e), param=prompt_param, code="invalid_prompt") from None
        self.usage.prompt_tokens = len(prompt_ids)
        _breakers_ahead(engine.tokenizer)

    async def events(self, disconnected: Disconnected | None = None
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        u, done = self.usage, self._done
        try:
            checked = time.monotonic()
            while len(done) < len(self._ids):
                try:
                    i, out = await asyncio.wait_for(self._q.get(), 0.5)
                except asyncio.TimeoutError:
                    i, out = -1, None
                # Events come every step, so look for a gone client by the clock.
                if disconnected is not None and time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await disconnected():
                        raise ClientGone()
                if out is None or i in done:
                    continue
                self.metrics.on_tokens(len(out.token_ids))
                if out.first_token_time is not None and (
                        u.first_token is None or out.first_token_time < u.first_token):
                    u.first_token = out.first_token_time
                if out.finished:
                    done.add(i)
                    u.completion_tokens += out.num_output_tokens
                    u.cached_tokens = max(u.cached_tokens, out.num_cached_tokens)
                    u.finish = out.finish_time or time.monotonic()
                    u.finish_reasons[i] = out.finish_reason or "stop"
                    self.metrics.on_finish(self.lm.name, out.finish_reason or "stop",
                                           out.num_prompt_tokens, out.num_output_tokens,
                                           out.num_cached_tokens, out.arrival_time,
                                           out.first_token_time, out.finish_time)
                    if out.finish_reason == "error":
                        raise APIError(500, out.error or "generation failed", code="engine_error")
                yield i, out
        finally:
            self.release()


async def start(manager: ModelManager, metrics: Metrics, model: str, n: int,
                backend: str | None = None, keep_alive: float | None = None,
                device: str | None = None, kv_cache_type: str | None = None) -> Generation:
    lm, load = await manager.acquire(model, backend, sequences=n, keep_alive=keep_alive,
                                     device=device, kv_cache_type=kv_cache_type)
    return Generation(manager, metrics, lm, load, n)


def streaming_response(gen: "Generation", agen: AsyncIterator[bytes], media_type: str,
                       source=None, headers: dict | None = None) -> StreamingResponse:
    """Stream agen's chunks; when the stream ends or the client goes, close `source` (the
    event iterator agen reads, or agen itself) and release the generation's requests."""
    async def body():
        try:
            async for chunk in agen:
                yield chunk
        finally:
            await (source or agen).aclose()
            gen.release()
    it = body()
    # A client gone before the first chunk means body() never starts, so its finally never
    # runs: release when the unstarted generator is collected instead.
    weakref.finalize(it, gen.release)
    return StreamingResponse(it, media_type=media_type, headers=headers)
