"""The boundary between the engine and a runner: plain data in, plain data out.

Each engine step the scheduler's decisions become one `StepPlan`; a runner executes it (one
forward pass over every scheduled span, then sampling) and returns a `StepResult`. Nothing
live crosses: no `Sequence` objects, no status strings, only request ids, token ids, block
tables and sampling settings, so a runner can sit behind a process or a network boundary.

Request lifetime on the runner side: a request id appears in `StepPlan.new_requests` the
first time it is scheduled (the runner creates its sampling state then), in `preempted` when
the scheduler dropped its KV (the runner forgets what it computed, keeps its sampling
state), and in `finished` once (the runner drops everything it holds for it).
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.formats.gguf_file import GGUFFile
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.runners.logprobs import PromptLogprobs


@dataclass(frozen=True)
class KVPlan:
    """The KV pool's shape, fixed at load: `num_blocks` blocks of `block_size` tokens for the
    full-attention layers (`bytes_per_token` for them all), and for models with
    sliding-window layers that the runner keeps apart (`window_layers`, which attend to the
    last `window` positions) a second pool of `window_blocks` blocks at
    `window_bytes_per_token` (see edgeinfer.engine.kv_manager)."""
    num_blocks: int
    block_size: int
    bytes_per_token: int
    window: int = 0
    window_blocks: int = 0
    window_bytes_per_token: int = 0
    window_layers: tuple[int, ...] = ()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return (self.capacity_tokens * self.bytes_per_token
                + self.window_blocks * self.block_size * self.window_bytes_per_token)

    @property
    def window_span_blocks(self) -> int:
        """Window blocks one sequence holds at most while it decodes."""
        return -(-(self.window - 1) // self.block_size) + 1 if self.window else 0

    def context_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens holds while it decodes."""
        blocks = -(-num_tokens // self.block_size)
        return self.block_size * (blocks * self.bytes_per_token
                                  + min(blocks, self.window_span_blocks)
                                  * self.window_bytes_per_token)

    @property
    def context_bytes_per_token(self) -> float:
        """What each token of a long context costs: the full-attention layers' bytes (the
        window layers' part stays at one window)."""
        return float(self.bytes_per_token)


def window_layers_of(cfg: ModelConfig) -> tuple[int, ...]:
    """The layers a separate sliding-window group can hold: sliding layers of a causal model
    that also has full-attention layers (Gemma 3's local layers), else none."""
    if not cfg.causal or not cfg.sliding_window:
        return ()
    layers = tuple(i for i in range(cfg.n_layers) if cfg.is_sliding(i))
    return layers if 0 < len(layers) < cfg.n_layers else ()


def window_note(path: str, bytes_per_value: float, block_size: int = 16) -> str:
    """For `show`: what a backend that keeps sliding-window layers apart stores per token
    of a long context, and a 32K context's KV ("" for models without such layers)."""
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    try:
        gf = read_gguf(path)
        try:
            cfg = load_model_config(gf)
        finally:
            gf.close()
    except Exception:       # a description only: never fail `show` over it
        return ""
    wl = window_layers_of(cfg)
    if not wl:
        return ""
    per_layer = 2 * cfg.n_kv_head * cfg.head_dim * bytes_per_value
    plan = KVPlan(1, block_size, round((cfg.n_layers - len(wl)) * per_layer),
                  cfg.sliding_window, 0, round(len(wl) * per_layer), wl)
    return (f"; {len(wl)} of {cfg.n_layers} layers see only the last {cfg.sliding_window} "
            f"tokens and keep only those: {plan.bytes_per_token:,} bytes/token past them, "
            f"{plan.context_bytes(32768) / 2**20:.0f} MB for a 32K context")


def plan_kv(cfg: ModelConfig, budget_bytes: int, bytes_per_value: float, block_size: int = 16,
            min_tokens: int = 0, windowed: bool = False, max_running_seqs: int = 16,
            max_tokens_per_step: int = 512) -> KVPlan:
    """Size the pool from a memory budget with 2 x layers x kv_heads x head_dim x bytes.

    `windowed` (the backend keeps sliding-window layers apart): their pool is sized for
    what the scheduler can use of it at most (each running sequence one window of blocks
    and a spare, plus one step's tokens), never more blocks than the full pool; the rest
    of the budget goes to the full-attention layers, so the context that fits grows by
    up to n_layers / full layers (6x for Gemma 3)."""
    per_layer = 2 * cfg.n_kv_head * cfg.head_dim * bytes_per_value
    wl = window_layers_of(cfg) if windowed else ()
    if not wl:
        per_token = -(-cfg.kv_bytes_per_token(bytes_per_value) // 1)
        per_token = int(per_token)
        tokens = max(budget_bytes // per_token, min_tokens)
        return KVPlan(max(1, tokens // block_size), block_size, per_token)
    full = int(-(-(cfg.n_layers - len(wl)) * per_layer // 1))
    win = int(-(-len(wl) * per_layer // 1))
    window = int(cfg.sliding_window)
    span = -(-(window - 1) // block_size) + 1
    cap = max_running_seqs * (span + 1) + -(-max_tokens_per_step // block_size)
    both = block_size * (full + win)
    if budget_bytes <= cap * both:
        num_blocks = budget_bytes // both
    else:
        num_blocks = cap + (budget_bytes - cap * both) // (block_size * full)
    num_blocks = max(1, num_blocks, -(-min_tokens // block_size))
    return KVPlan(num_blocks, block_size, full, window, min(num_blocks, cap), win, wl)


@dataclass(frozen=True)
class ImageSpan:
    """Positions start..start+len(embeddings)-1 of a prompt are an image: their inputs are
    these embeddings (not token embeddings), and they attend to every position of the image
    (edgeinfer.engine.images)."""
    start: int
    embeddings: np.ndarray      # float32 [tokens, text width]
    digest: str
    # its positions attend to the whole image (Gemma 3), else causally like text (Idefics3)
    bidirectional: bool = True

    @property
    def end(self) -> int:
        return self.start + int(self.embeddings.shape[0])


@dataclass(frozen=True)
class NewRequest:
    """What a runner keeps for a request from its first step to its last."""
    req_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    choice_index: int = 0               # n > 1: choice i draws from spawn key i of the seed
    # embeddings: a prefill-only request whose spans never sample; the runner pools the final
    # hidden states of all its prompt positions ("mean", "cls", "last", "rank" or "none") and
    # returns the result in StepResult.hidden in the step that computes its last position
    pooling: str | None = None
    # the prompt's images, in order (their positions hold placeholder ids, see engine/images)
    images: tuple[ImageSpan, ...] = ()


@dataclass(frozen=True)
class ScheduledSpan:
    """Compute K/V for positions start..start+len(token_ids)-1 of request `req_id` into its
    block table, attending over positions 0..end-1; when `sample` is set the span ends at the
    request's last known token and one token is sampled from the logits there, restricted
    to `token_mask` (bool [vocab], True = allowed) when one is given.

    `prompt_logprobs = k`: the runner also returns, for each position p of the span whose
    row predicts a prompt token (p + 1 < prompt length), log P(prompt[p + 1] | prefix) and
    the k best alternatives (StepResult.prompt_logprobs; computed in chunks of rows, see
    edgeinfer.runners.logprobs). The engine sets it only on spans of a request that asked,
    and admits such a request without prefix-cache reuse, so its spans cover every position.

    `num_draft = k` (speculative decoding, `sample` set): the last k token_ids are a guess,
    not known tokens. The runner samples at each of the last k + 1 positions in order, as
    plain decoding would, and stops at the first sample that differs from the guess: the
    request's tokens in StepResult are the accepted guesses and that one sample."""
    req_id: int
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool
    token_mask: np.ndarray | None = None
    prompt_logprobs: int | None = None
    num_draft: int = 0
    # the sliding-window layers' table (KVPlan.window_layers), indexed like block_table; its
    # entries out of every window of the span are -1 and never read
    window_table: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.sample and len(self.token_ids) == 1 + self.num_draft and self.start > 0


@dataclass(frozen=True)
class StepPlan:
    spans: tuple[ScheduledSpan, ...]            # decodes first, then prefill chunks
    new_requests: tuple[NewRequest, ...] = ()
    preempted: tuple[int, ...] = ()             # KV dropped: will recompute from position 0
    finished: tuple[int, ...] = ()              # gone: release everything held for them

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans)


@dataclass
class StepResult:
    """Per request id that sampled this step: its new tokens (a list, so a speculative
    verifier can accept several), their logprobs when asked, and the top alternatives."""
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # prompt tokens the runner did not recompute because its own cache held them (the
    # llama.cpp runner's slot reuse); the native runners' reuse is the prefix cache's
    reused_tokens: dict[int, int] = field(default_factory=dict)
    # pooled hidden states for prefill-only requests (embeddings), float32 [hidden] (pooling
    # "none": [prompt tokens, hidden]; "rank": [classes]), not normalized
    hidden: dict[int, np.ndarray] | None = None
    # requests whose row could not be sampled (a token mask that allows nothing): the engine
    # ends them with this message; the rest of the batch is unaffected
    errors: dict[int, str] = field(default_factory=dict)
    # per request whose span asked: prompt logprobs of the positions this step computed
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


class KVAllocator(Protocol):
    """Block tables for the scheduler (edgeinfer.engine.kv_manager.KVCacheManager is the one
    implementation; a runner says how to build it: with or without a prefix cache)."""
    num_blocks: int
    block_size: int


class Runner(Protocol):
    """One loaded model on one backend, executing one step at a time (engine thread only)."""
    gf: GGUFFile                  # the model's file (its metadata: chat template, tokens...)
    cfg: ModelConfig
    kv_plan: KVPlan
    kind: str                     # "cpu", "torch:cuda", "llamacpp", ...
    weights_format: str           # how the weights sit in memory, for show / ps
    prefix_caching: bool          # False: block ids are capacity accounting only
    # verifies ScheduledSpan.num_draft guesses, each verified position with exactly the bits
    # plain decoding would give it (so speculation never changes the output)
    supports_drafts: bool
    # takes image embeddings in place of tokens (ImageSpan in NewRequest.images)
    supports_images: bool
    pooling: str | None           # how embeddings pool ("mean", "cls", "last", "rank"); None: none
    embedding_only: bool          # no LM head: embeddings only

    @property
    def tokenizer(self): ...
    def set_context_length(self, n_ctx: int) -> None:
        """The engine's context per sequence, before any token (phi3's LongRoPE factors)."""
    def image_encoder(self, mmproj: str) -> Any | None:
        """The runner's own library's encoder for the projector at `mmproj` (llama.cpp's
        libmtmd): a callable RGB pixels -> embeddings; None: the engine runs the native
        tower (edgeinfer.engine.images)."""
    def execute(self, plan: StepPlan) -> StepResult: ...
    @property
    def weights_bytes(self) -> int: ...      # what the backend holds for the weights
    @property
    def kv_bytes(self) -> int: ...           # the KV pool as allocated
    def close(self) -> None: ...


def start_thread(fn, *args, name: str) -> concurrent.futures.Future:
    """fn(*args) on a thread of its own (not a pool that outlives it); .result() joins and
    re-raises what it raised. For load-time work beside GIL-free kernels or another process."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:        # handed to whoever asks for the result
            fut.set_exception(e)
    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
