"""Request bodies of both APIs as pydantic models.

Types are checked here (a wrong type is a 400 naming the field); value ranges are checked by
`SamplingParams`, whose ValueError names the field too. Unknown fields are accepted and
ignored, as the real servers do, so clients that send extras keep working; the fields we
accept but do not act on are listed in IGNORED_* (and in docs/api.md).
"""
from __future__ import annotations

from typing import Any, Literal, Union

KVCacheType = Literal["f16", "q8_0"]    # edgeinfer.settings.KV_CACHE_TYPES

from pydantic import BaseModel, ConfigDict, Field

# ----- OpenAI ------------------------------------------------------------------------------

OPENAI_IGNORED = ("user", "service_tier", "store", "metadata", "modalities",
                  "audio", "web_search_options", "best_of (must equal n)",
                  "suffix")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _LlamaSamplers(_Loose):
    """llama.cpp's samplers under llama-server's names (Ollama's options use the same ones
    for typical_p, mirostat*, repeat_last_n), and edgeinfer's repetition stop. None = the
    default (off, or the model's default: see generation.Generation.adapt)."""
    typical_p: float | None = None
    repeat_last_n: int | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # edgeinfer: finish with reason "repetition" once the output copies itself verbatim
    stop_on_repetition: bool | None = None


SAMPLER_FIELDS = ("typical_p", "repeat_last_n", "xtc_probability", "xtc_threshold",
                  "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                  "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta")


def sampler_kwargs(obj, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The llama.cpp sampler fields `obj` sets, as SamplingParams keywords."""
    if obj is None:
        return {}
    return {k: getattr(obj, k) for k in SAMPLER_FIELDS
            if k not in skip and getattr(obj, k, None) is not None}


class ContentPart(_Loose):
    type: str
    text: str | None = None


class FunctionCall(_Loose):
    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCallIn(_Loose):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Loose):
    include_usage: bool = False


class _OpenAISampling(_LlamaSamplers):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions that llama-server and vLLM accept too
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None         # llama-server's name for it
    ignore_eos: bool = False
    # edgeinfer extensions (the Ollama API's options.backend / options.device): which backend
    # loads the model and on which device torch runs it
    backend: str | None = None
    device: str | None = None
    # load option (Ollama: options.kv_cache_type): the KV cache's type, as llama.cpp's
    # --cache-type-k/v; a model loaded with another type reloads (when idle)
    kv_cache_type: KVCacheType | None = None
    # llama-server's grammar extensions: a GBNF grammar, or a JSON schema, for the output
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # structured output and tools (edgeinfer.server.tools, edgeinfer.engine.grammar)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    # gpt-oss style templates' reasoning level (edgeinfer.server.harmony.effort_vars)
    reasoning_effort: str | None = None
    # Predicted Outputs: text the answer will mostly repeat (speculative drafts come from it)
    prediction: dict[str, Any] | None = None


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None


# ----- Ollama ------------------------------------------------------------------------------

OLLAMA_IGNORED = ("template", "context", "suffix",
                  "options.num_keep", "options.tfs_z",
                  "options.penalize_newline", "options.num_batch",
                  "options.num_gpu", "options.main_gpu", "options.num_thread",
                  "options.use_mmap", "options.use_mlock", "options.numa",
                  "options.low_vram", "options.f16_kv", "options.vocab_only")


class OllamaOptions(_LlamaSamplers):
    num_predict: int | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    # edgeinfer extensions: which backend runs the model (auto, cpu, torch, torch:DEVICE,
    # llamacpp) and on which device torch runs it (cuda, mps, cpu), and the KV cache type
    backend: str | None = None
    device: str | None = None
    kv_cache_type: KVCacheType | None = None


KeepAlive = Union[float, str, None]


class _OllamaBase(_Loose):
    model: str = Field(min_length=1)
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # structured output ("json" or a JSON schema) and reasoning (true/false/"low"/...)
    format: Union[str, dict[str, Any], None] = None
    think: Union[bool, str, None] = None


class GenerateRequest(_OllamaBase):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None


class OllamaToolCall(_Loose):
    function: FunctionCall


class OllamaMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(_OllamaBase):
    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None


class ModelNameRequest(_Loose):
    model: str | None = None
    name: str | None = None          # older clients send `name`

    def model_name(self) -> str | None:
        return self.model or self.name


class PullRequest(ModelNameRequest):
    stream: bool = True
    insecure: bool = False
    # edgeinfer extensions used by `edgeinfer pull` through the daemon
    as_name: str | None = Field(default=None, alias="as")
    sha256: str | None = None


class CopyRequest(_Loose):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)
