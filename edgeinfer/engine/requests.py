"""What a loaded engine tells its clients about itself, and the checks every request passes
before it is queued. Both hold in the daemon's process as in the engine's, so an engine in
its own process (edgeinfer.engine.remote) refuses a bad request with the same sentence,
before anything crosses to it."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgeinfer.engine.images import placeholder_ids
from edgeinfer.engine.prompt_scoring import PromptScoring
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.formats.model_config import ModelConfig


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, bad parameter); a 400 in the API."""


@dataclass(frozen=True)
class EngineInfo:
    """A loaded engine's figures and limits (plain data: it crosses processes)."""
    cfg: ModelConfig
    kind: str                   # the runner: cpu, torch, llamacpp
    weights_format: str         # gguf (quantized), gguf (llama.cpp), torch's dtype
    weights_bytes: int          # the runner's weights plus the projector's file
    kv_bytes: int
    kv_bytes_per_token: int
    kv_window: int              # sliding-window layers kept apart hold this many tokens
    max_model_len: int          # context per sequence
    capacity_tokens: int        # what the KV pool holds
    pooling: str | None         # how embeddings pool; None when the runner cannot embed
    embedding_only: bool
    vision: bool                # a projector is loaded and takes images
    vision_note: str            # why image requests are refused (text-only or unsupported)

    @property
    def max_embed_tokens(self) -> int:
        """The longest embedding input (the scheduler keeps one position free)."""
        return min(self.max_model_len - 1, self.capacity_tokens - 1)


def no_images_note(name: str | None) -> str:
    """What an image request to a model without a projector gets."""
    return (f"{name or 'this model'!r} is a text-only model here: it has no vision projector, "
            "so it cannot take images (pull it with --mmproj FILE)")


def _bad_token(prompt_ids, vocab_size: int, images: tuple) -> int | None:
    """The first id outside the vocabulary, image placeholder positions excepted."""
    skip = set()
    for im in images:
        skip.update(range(im.start, im.end))
    for i, t in enumerate(prompt_ids):
        if not 0 <= t < vocab_size and i not in skip:
            return t
    return None


def _check_images(info: EngineInfo, prompt_ids: list[int], images: tuple,
                  prompt_logprobs) -> None:
    if not info.vision:
        raise RequestError(info.vision_note)
    if prompt_logprobs is not None:
        raise RequestError("prompt logprobs are not supported for prompts with images")
    prev = 0
    for im in images:
        if im.start < prev or im.end > len(prompt_ids) or \
                list(prompt_ids[im.start:im.end]) != placeholder_ids(im.digest, im.end - im.start):
            raise RequestError("image spans do not match the prompt's image positions")
        if im.embeddings.shape[1:] != (info.cfg.n_embd,):
            raise RequestError("image embeddings do not match the model's width")
        prev = im.end


def check_request(info: EngineInfo, prompt_ids: list[int], params: SamplingParams,
                  images: tuple = (), prompt_logprobs: int | None = None,
                  score_only: bool = False, prediction: list[int] | None = None
                  ) -> tuple[SamplingParams, PromptScoring | None, np.ndarray | None]:
    """RequestError for what can never run; else the params with max_tokens fitted to the
    context, the prompt scoring wanted, and the prediction as an array."""
    vocab = info.cfg.vocab_size
    if info.embedding_only:
        raise RequestError(f"{info.cfg.name!r} is an embedding model: it cannot generate "
                           "text (use /api/embed or /v1/embeddings)")
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    n = len(prompt_ids)
    if n >= info.max_model_len:
        raise RequestError(f"the prompt is {n} tokens, but the context is {info.max_model_len} "
                           f"tokens (leave room for at least one output token)")
    if info.capacity_tokens < n + 1:
        raise RequestError(f"the prompt is {n} tokens, more than the KV cache holds "
                           f"({info.capacity_tokens} tokens)")
    if images:
        _check_images(info, prompt_ids, images, prompt_logprobs)
    bad = _bad_token(prompt_ids, vocab, images)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    try:
        params.validate(vocab)
    except ValueError as e:
        raise RequestError(str(e)) from None
    room = info.max_model_len - n
    if params.max_tokens is None or params.max_tokens > room:
        params = replace(params, max_tokens=room if params.max_tokens is None else
                         min(params.max_tokens, room))
    scoring = None
    if prompt_logprobs is not None or score_only:
        try:
            scoring = PromptScoring(n, prompt_logprobs, bool(score_only))
        except ValueError as e:
            raise RequestError(str(e)) from None
    pred = None
    if prediction:
        pred = np.asarray(prediction, np.int64)
        if ((pred < 0) | (pred >= vocab)).any():
            raise RequestError("a prediction token id is outside the vocabulary")
    return params, scoring, pred


def check_embed(info: EngineInfo, prompt_ids: list[int]) -> None:
    """RequestError for an embedding input this engine cannot take."""
    if info.pooling is None:
        raise RequestError(f"the {info.kind} backend cannot compute embeddings; "
                           "load the model on the native backend (cpu or torch)")
    if not prompt_ids:
        raise RequestError("the input is empty")
    n = len(prompt_ids)
    if n > info.max_embed_tokens:
        raise RequestError(f"the input is {n} tokens, more than the {info.max_embed_tokens} "
                           "this model takes")
    bad = _bad_token(prompt_ids, info.cfg.vocab_size, ())
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary "
                           f"(0..{info.cfg.vocab_size - 1})")
