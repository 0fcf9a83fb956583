"""GGUF metadata -> a typed, validated `ModelConfig` for the architectures we run natively."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from edgeinfer.formats.ggml_types import LlamaFileType

from edgeinfer.formats.gguf_file import GGUFError, GGUFFile

NATIVE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "bert", "nomic-bert", "gemma-embedding",
                "phi3", "smollm3", "mistral3", "qwen3moe", "gpt-oss", "qwen2moe",
                "dots1")
# encoders: they embed (and rerank) but have no language-model head to generate with
EMBEDDING_ARCHS = ("bert", "nomic-bert", "gemma-embedding")
# mixture of experts: the native model runs on the numba CPU backend only (auto picks it);
# so does a `llama` file with experts (Mixtral): cpu_only_file
CPU_ONLY_ARCHS = ("qwen3moe", "gpt-oss", "qwen2moe", "dots1")
# the tensor types the native CPU kernels read (backends/cpu: quants.SUPPORTED_TYPES and
# mxfp4.py; tests/test_gpt_oss.py holds the two lists equal): a gpt-oss file with another
# is run by llama.cpp under auto
NATIVE_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"})


class UnsupportedArchitecture(GGUFError):
    pass


class UnsupportedFeature(GGUFError):
    """A valid file of a native architecture that uses something the native engine does not
    implement (a rope scaling type, an expert gating function, ...): the message names the
    key; `--backend auto` runs such a file on llama.cpp instead (native_reason)."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_neox: bool              # rotate halves (NeoX) rather than adjacent pairs (GPT-J/llama)
    rope_scale: float = 1.0      # linear position scaling (positions divided by this)
    rope_base_local: float = 0.0  # gemma3 sliding-window layers
    sliding_window: int = 0      # 0 = every layer global
    swa_pattern: int = 0         # gemma3: every swa_pattern-th layer is global
    qk_norm: bool = False
    qkv_bias: bool = False
    embed_scale: float = 1.0
    tied_output: bool = False
    post_norms: bool = False     # gemma3 post-attention / post-ffw norms
    activation: str = "silu"     # silu (SwiGLU) or gelu_tanh (GeGLU)
    has_rope_freqs: bool = False  # llama3 per-dimension rope factors tensor
    causal: bool = True          # False: encoders (bert), every token sees its whole sequence
    n_token_types: int = 0       # bert: rows of token_types.weight
    n_cls_out: int = 0           # bert rerankers: classification head outputs (0 = no head)
    fused_qkv: bool = False      # nomic-bert, phi3: one attn_qkv matrix (q, k, v rows in order)
    fused_up: bool = False       # phi3: ffn_up holds gate then up rows (2 x n_ff), no ffn_gate
    n_rot: int = 0               # rotated dims of a head (rope.dimension_count); 0 = head_dim
    rope_mscale: float = 1.0     # cos/sin multiplier (phi3's rope.scaling.attn_factor, YaRN)
    rope_factors: str = ""       # phi3 LongRoPE: "short" / "long" rope_factors_* tensors
    rope_orig_ctx: int = 0       # phi3: rope.scaling.original_context_length (long factors past it)
    yarn_factor: float = 0.0     # YaRN context scale (0 = none), folded into per-dim factors
    yarn_orig_ctx: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0    # rope.scaling.yarn_log_multiplier (mscale_all_dim)
    no_rope_step: int = 0        # smollm3: every no_rope_step-th layer skips rope
    attn_temp_scale: float = 0.0  # mistral3: Llama 4 style q scaling by position (0 = off)
    attn_temp_floor: int = 0
    n_expert: int = 0            # qwen3moe: routed experts, of which n_expert_used per token
    n_expert_used: int = 0
    n_ff_exp: int = 0
    # routing as llama.cpp's build_moe_ffn (models/moe.py): gating "softmax" or "sigmoid"
    # over all experts, the top k (by probability plus exp_probs_b when expert_bias), their
    # probabilities as weights, divided by their sum when expert_norm, times expert_scale
    # unless it is 0 or 1
    expert_gating: str = "softmax"
    expert_norm: bool = True
    expert_scale: float = 0.0
    expert_bias: bool = False
    n_ff_shexp: int = 0          # shared expert's FFN width (0: none): qwen2moe, dots1
    n_dense_lead: int = 0        # dots1: the first layers have a dense FFN instead of experts
    shexp_gate: bool = False     # qwen2moe: shared expert output times sigmoid(h . gate_inp_shexp)

    @property
    def rot_dim(self) -> int:
        return self.n_rot or self.head_dim

    def uses_rope(self, layer: int) -> bool:
        return not (self.no_rope_step and (layer + 1) % self.no_rope_step == 0)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window and self.swa_pattern and (layer + 1) % self.swa_pattern)

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> int:
        """The DESIGN.md formula: 2 x layers x kv_heads x head_dim x bytes_per_value (34/32
        for q8_0: whole blocks, since head_dim is a multiple of 32 there)."""
        return round(2 * self.n_layers * self.n_kv_head * self.head_dim * bytes_per_value)


def _meta(f: GGUFFile, arch: str, key: str, default=None, kind=int):
    full = f"{arch}.{key}"
    v = f.metadata.get(full, default)
    if v is None:
        raise GGUFError(f"is missing the required metadata key {full!r}")
    if hasattr(v, "shape") and getattr(v, "ndim", 0):   # per-layer arrays: need a uniform value
        if len(v) == 0 or (v != v[0]).any():
            raise GGUFError(f"metadata {full!r} varies per layer, which is not supported")
        v = v[0]
    try:
        v = kind(v)
    except (TypeError, ValueError):
        raise GGUFError(f"metadata {full!r} has an invalid value {v!r}") from None
    return v


def _positive(name: str, v: int, limit: int) -> int:
    if not 0 < v <= limit:
        raise GGUFError(f"has an implausible {name} of {v}")
    return v


def load_model_config(f: GGUFFile) -> ModelConfig:
    """Build and check the config; verify required tensors and their shapes."""
    arch = f.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("has no general.architecture metadata")
    if arch not in NATIVE_ARCHS:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported by the native engine "
            f"(supported: {', '.join(NATIVE_ARCHS)}); run it with --backend llamacpp")
    n_embd = _positive("embedding length", _meta(f, arch, "embedding_length"), 1 << 16)
    n_layers = _positive("block count", _meta(f, arch, "block_count"), 1024)
    n_ff = _positive("feed-forward length", _meta(f, arch, "feed_forward_length"), 1 << 18)
    n_head = _positive("head count", _meta(f, arch, "attention.head_count"), 1024)
    n_kv = _positive("KV head count", _meta(f, arch, "attention.head_count_kv", n_head), n_head)
    if n_head % n_kv:
        raise GGUFError(f"has {n_head} heads, not a multiple of its {n_kv} KV heads")
    head_dim = _positive("head dim", _meta(f, arch, "attention.key_length", n_embd // n_head), 4096)
    v_dim = _meta(f, arch, "attention.value_length", head_dim)
    if v_dim != head_dim:
        raise GGUFError(f"has different key ({head_dim}) and value ({v_dim}) head sizes")
    ctx = _positive("context length", _meta(f, arch, "context_length", 2048), 1 << 24)
    encoder = arch in ("bert", "nomic-bert")
    eps = _meta(f, arch, "attention.layer_norm_epsilon" if encoder else
                "attention.layer_norm_rms_epsilon", 1e-12 if encoder else 1e-5, float)
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError("has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    vocab = len(tokens)
    rope_base = _meta(f, arch, "rope.freq_base", 10000.0, float)
    scaling = f.metadata.get(f"{arch}.rope.scaling.type", "none")
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = _meta(f, arch, "rope.scaling.factor", 1.0, float)
    elif scaling not in ("none", None) and not (arch in ("mistral3", "gpt-oss")
                                                and scaling == "yarn"):
        raise UnsupportedFeature(f"uses rope scaling {scaling!r} ('{arch}.rope.scaling.type'), which "
                                 f"the native engine does not support for {arch}; "
                        f"run it with --backend llamacpp")
    if not (math.isfinite(eps) and 0 < eps < 1 and math.isfinite(rope_base) and rope_base > 0
            and math.isfinite(rope_scale) and rope_scale > 0):
        raise GGUFError("has invalid normalization or rope parameters")

    tied = "output.weight" not in f.tensors
    common = dict(arch=arch, name=str(f.metadata.get("general.name", arch)), n_layers=n_layers,
                  n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_kv_head=n_kv, head_dim=head_dim,
                  vocab_size=vocab, context_length=ctx, rms_eps=eps, rope_base=rope_base,
                  rope_scale=rope_scale, tied_output=tied)
    if arch in ("gemma3", "gemma-embedding"):
        # gemma-embedding (EmbeddingGemma): the gemma3 block with bidirectional attention,
        # its local layers over a symmetric window
        cfg = ModelConfig(**common, rope_neox=True, causal=arch == "gemma3",
                          rope_base_local=_meta(f, arch, "rope.freq_base_swa", 10000.0, float),
                          sliding_window=_meta(f, arch, "attention.sliding_window", 0),
                          swa_pattern=6, qk_norm=True, embed_scale=math.sqrt(n_embd),
                          post_norms=True, activation="gelu_tanh")
    elif encoder:
        types = f.tensors.get("token_types.weight")
        cls_out = f.tensors.get("cls.output.weight")
        # nomic-bert: rotary positions (NeoX), SwiGLU; bert: absolute positions, GELU
        cfg = ModelConfig(**common, rope_neox=arch == "nomic-bert",
                          fused_qkv="blk.0.attn_qkv.weight" in f.tensors,
                          activation="silu" if arch == "nomic-bert" else "gelu", causal=False,
                          n_token_types=int(types.shape[1]) if types is not None and
                          len(types.shape) == 2 else 0,
                          n_cls_out=int(cls_out.shape[1]) if cls_out is not None and
                          len(cls_out.shape) == 2 else 0)
    elif arch in ("qwen3", "qwen3moe", "dots1"):
        cfg = ModelConfig(**common, rope_neox=True, qk_norm=True, **_moe_config(f, arch, n_ff))
    elif arch in ("phi3", "smollm3", "mistral3"):
        cfg = _llama_variant(f, arch, common)
    elif arch in ("qwen2", "qwen2moe"):
        cfg = ModelConfig(**common, rope_neox=True, qkv_bias="blk.0.attn_q.bias" in f.tensors,
                          **_moe_config(f, arch, n_ff))
    elif arch == "gpt-oss":
        cfg = _gpt_oss_config(f, common)
    else:       # llama; with expert_count > 0 Mixtral's routed experts (build_llama's MoE)
        cfg = ModelConfig(**common, rope_neox=False, has_rope_freqs="rope_freqs.weight" in f.tensors,
                          **_moe_config(f, arch, n_ff))
    check_tensors(f, cfg)
    return cfg


def _llama_variant(f: GGUFFile, arch: str, common: dict) -> ModelConfig:
    """phi3 (fused qkv and gate/up, NeoX rope, partial rotary, LongRoPE factors), smollm3 (no
    rope on every 4th layer, as llama.cpp hard-codes), mistral3 (YaRN, attention temperature)."""
    head_dim = common["head_dim"]
    n_rot = _meta(f, arch, "rope.dimension_count", head_dim)
    if n_rot % 2 or not 0 < n_rot <= head_dim:
        raise GGUFError(f"metadata '{arch}.rope.dimension_count' = {n_rot} does not fit the "
                        f"head size {head_dim}")
    extra: dict = {}
    if arch == "phi3":
        extra = dict(rope_neox=True, fused_qkv="blk.0.attn_qkv.weight" in f.tensors,
                     fused_up="blk.0.ffn_gate.weight" not in f.tensors,
                     rope_mscale=_meta(f, arch, "rope.scaling.attn_factor", 1.0, float),
                     # the short ones; the long ones when the engine's context exceeds the
                     # original one, as llama.cpp (VariantModel.set_context_length)
                     rope_factors="short" if "rope_factors_short.weight" in f.tensors else "",
                     rope_orig_ctx=_meta(f, arch, "rope.scaling.original_context_length",
                                         common["context_length"]))
    elif arch == "smollm3":
        extra = dict(rope_neox=False, no_rope_step=4)
    else:
        extra = dict(rope_neox=False,
                     has_rope_freqs="rope_freqs.weight" in f.tensors,
                     attn_temp_scale=_meta(f, arch, "attention.temperature_scale", 0.0, float))
        if f.metadata.get(f"{arch}.rope.scaling.type") == "yarn":
            factor = _meta(f, arch, "rope.scaling.factor", 1.0, float)
            orig = _meta(f, arch, "rope.scaling.original_context_length",
                         common["context_length"])
            if factor > 1.0:
                extra.update(yarn_factor=factor, yarn_orig_ctx=orig, yarn_log_mul=_meta(
                                 f, arch, "rope.scaling.yarn_log_multiplier", 0.0, float),
                             yarn_beta_fast=_meta(f, arch, "rope.scaling.yarn_beta_fast", 32.0, float),
                             yarn_beta_slow=_meta(f, arch, "rope.scaling.yarn_beta_slow", 1.0, float))
        if extra["attn_temp_scale"]:
            extra["attn_temp_floor"] = _positive(
                "original context length", _meta(f, arch, "rope.scaling.original_context_length",
                                                 common["context_length"]), 1 << 24)
    return ModelConfig(**common, n_rot=n_rot if n_rot != head_dim else 0, **extra)


def _gpt_oss_config(f: GGUFFile, common: dict) -> ModelConfig:
    """gpt-oss as llama.cpp's LLM_ARCH_OPENAI_MOE: NeoX rope with YaRN, every other layer
    (0, 2, ...) sliding-window (set_swa_pattern(2)), biases on q/k/v/o, attention sinks,
    routed experts with softmax over the top-k router logits (gating hard-coded there)."""
    arch = "gpt-oss"
    for name, t in f.tensors.items():
        # MXFP4 is multiplied in place, never looked up by rows: not for the embedding table
        if t.type_name not in NATIVE_TENSOR_TYPES or (
                t.type_name == "MXFP4" and name == "token_embd.weight"):
            raise UnsupportedFeature(f"tensor {name!r} is of type {t.type_name}, which the native "
                                     f"{arch} does not implement; run it with --backend llamacpp")
    pattern = f.metadata.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and not (isinstance(pattern, int) and pattern == 2):
        raise UnsupportedFeature(f"metadata '{arch}.attention.sliding_window_pattern' = {pattern!r} "
                                 "is not the alternate-layer pattern the native gpt-oss "
                                 "implements; run it with --backend llamacpp")
    window = _positive("sliding window", _meta(f, arch, "attention.sliding_window"), 1 << 24)
    extra: dict = {}
    if f.metadata.get(f"{arch}.rope.scaling.type") == "yarn":
        factor = _meta(f, arch, "rope.scaling.factor", 1.0, float)
        if factor > 1.0:
            extra = dict(yarn_factor=factor, yarn_orig_ctx=_meta(
                             f, arch, "rope.scaling.original_context_length", 4096),
                         yarn_log_mul=_meta(f, arch, "rope.scaling.yarn_log_multiplier", 0.0, float),
                         yarn_beta_fast=_meta(f, arch, "rope.scaling.yarn_beta_fast", 32.0, float),
                         yarn_beta_slow=_meta(f, arch, "rope.scaling.yarn_beta_slow", 1.0, float))
    n_rot = _meta(f, arch, "rope.dimension_count", common["head_dim"])
    if n_rot != common["head_dim"]:
        raise UnsupportedFeature(f"metadata '{arch}.rope.dimension_count' = {n_rot} is not the "
                                 f"head size {common['head_dim']}, which the native {arch} "
                                 "implements; run it with --backend llamacpp")
    return ModelConfig(**common, rope_neox=True, sliding_window=window, swa_pattern=2,
                       qkv_bias=True, **extra, **_moe_config(f, arch, common["n_ff"]))


def _moe_config(f: GGUFFile, arch: str, n_ff: int) -> dict:
    """Routed-expert hyper-parameters (qwen3moe, gpt-oss, qwen2moe, llama with experts); a
    key we do not implement is an error naming it, never silently different numbers."""
    if arch not in ("qwen3moe", "gpt-oss", "qwen2moe", "llama", "dots1"):
        return {}
    if arch == "llama" and not f.metadata.get(f"{arch}.expert_count"):
        return {}           # a dense llama
    n_expert = _positive("expert count", _meta(f, arch, "expert_count"), 4096)
    used = _meta(f, arch, "expert_used_count")
    if not 0 < used <= n_expert:
        raise GGUFError(f"metadata '{arch}.expert_used_count' = {used} is not in 1..{n_expert}")
    gating = f.metadata.get(f"{arch}.expert_gating_func")
    # 1 = softmax (llama.cpp's enum); gpt-oss: llama.cpp's graph hard-codes softmax over the
    # top-k logits (SOFTMAX_WEIGHT, 3) and reads no key; dots1 reads it: 1 or 2 (sigmoid)
    if arch == "dots1":
        gating = _meta(f, arch, "expert_gating_func")
        if gating not in (1, 2):
            raise UnsupportedFeature(f"metadata '{arch}.expert_gating_func' = {gating} is not "
                                     f"softmax (1) or sigmoid (2) gating, which is what the native "
                                     f"{arch} implements; run it with --backend llamacpp")
    elif gating is not None and int(gating) != (3 if arch == "gpt-oss" else 1):
        raise UnsupportedFeature(f"metadata '{arch}.expert_gating_func' = {int(gating)} is not softmax "
                        f"gating, which is all the native {arch} implements; run it with "
                        "--backend llamacpp")
    # qwen2moe has one shared expert (llama.cpp reads no count for it); llama.cpp's llama
    # and qwen2moe graphs hard-code softmax and read no weights scale: a file that says
    # otherwise is left to llama.cpp rather than guessed at
    shared_ok = (0.0, 1.0) if arch == "qwen2moe" else (0.0,)
    checks = (("expert_group_count", (0.0, 1.0)),) if arch == "dots1" else (
        ("expert_shared_count", shared_ok), ("expert_weights_scale", (0.0, 1.0)),
        ("expert_group_count", (0.0, 1.0)))
    for key, ok in checks + (
                        (("expert_shared_feed_forward_length", (0.0,)),) if arch == "llama" else ()):
        v = f.metadata.get(f"{arch}.{key}")
        if v is not None and float(v) not in ok:
            raise UnsupportedFeature(f"metadata '{arch}.{key}' = {v} is not supported by the native "
                            f"{arch}; run it with --backend llamacpp")
    extra: dict = {}
    if arch == "llama":     # llama.cpp's llama reads n_ff for its experts, no expert key
        ff_exp = n_ff
        if "blk.0.ffn_gate_exps.weight" not in f.tensors and "blk.0.ffn_up_exps.weight" in f.tensors:
            raise UnsupportedFeature("has experts without ffn_gate_exps (an ungated expert FFN), "
                                     "which the native llama does not implement; run it with "
                                     "--backend llamacpp")
    else:
        ff_exp = _meta(f, arch, "expert_feed_forward_length", n_ff // used)
    if arch == "qwen2moe":  # softmax, top k, not renormalized; a sigmoid-gated shared expert
        extra = dict(expert_norm=False, shexp_gate=True, n_ff_shexp=_positive(
            "shared expert feed-forward length",
            _meta(f, arch, "expert_shared_feed_forward_length", n_ff), 1 << 18))
    if arch == "dots1":
        extra = _dots1_config(f, arch, n_expert, ff_exp)
    return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=_positive(
        "expert feed-forward length", ff_exp, 1 << 18), **extra)


def _dots1_config(f: GGUFFile, arch: str, n_expert: int, ff_exp: int) -> dict:
    """dots1 as llama.cpp's build_dots1: `leading_dense_block_count` dense layers first; then
    experts routed by the file's gating (softmax or sigmoid) with the optional selection bias
    `exp_probs_b`, weights normalized when `expert_weights_norm`, times
    `expert_weights_scale`; `expert_shared_count` shared experts as one SwiGLU FFN of
    expert_feed_forward_length x that count."""
    lead = _meta(f, arch, "leading_dense_block_count", 0)
    n_layers = _meta(f, arch, "block_count")
    if not 0 <= lead < n_layers:
        raise GGUFError(f"metadata '{arch}.leading_dense_block_count' = {lead} leaves no "
                        "layer with experts")
    scale = _meta(f, arch, "expert_weights_scale", 0.0, float)
    if not math.isfinite(scale):
        raise GGUFError(f"metadata '{arch}.expert_weights_scale' = {scale} is not finite")
    shared = _meta(f, arch, "expert_shared_count")
    if not 0 <= shared <= n_expert:
        raise GGUFError(f"metadata '{arch}.expert_shared_count' = {shared} is implausible")
    gating = "sigmoid" if _meta(f, arch, "expert_gating_func") == 2 else "softmax"
    return dict(expert_gating=gating, expert_norm=bool(f.metadata.get(
                    f"{arch}.expert_weights_norm", False)),
                expert_scale=scale, n_ff_shexp=ff_exp * shared, n_dense_lead=lead,
                expert_bias=f"blk.{lead}.exp_probs_b.bias" in f.tensors)


def cpu_only_file(f: GGUFFile) -> bool:
    """Whether the native model of this file runs on the CPU backend only: a mixture of
    experts (CPU_ONLY_ARCHS, or a llama file with experts: Mixtral)."""
    arch = f.metadata.get("general.architecture")
    return arch in CPU_ONLY_ARCHS or bool(f.metadata.get(f"{arch}.expert_count"))


def native_reason(f: GGUFFile) -> str | None:
    """Why the native engine will not run this file (its architecture, or a feature of it it
    does not implement), or None. A file broken in other ways gives None here: its load
    reports that."""
    arch = f.metadata.get("general.architecture")
    if arch not in NATIVE_ARCHS:
        return f"architecture {arch!r} has no native model"
    try:
        load_model_config(f)
    except UnsupportedFeature as e:
        return str(e)
    except GGUFError:
        return None
    return None


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its ggml shape."""
    if cfg.arch in ("bert", "nomic-bert"):
        return _bert_tensors(cfg)
    e, q, kv, ff = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, cfg.vocab_size),
        "output_norm.weight": (e,),
    }
    if not cfg.tied_output:
        shapes["output.weight"] = (e, cfg.vocab_size)
    if cfg.has_rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rot_dim // 2,)
    if cfg.rope_factors:
        shapes["rope_factors_long.weight"] = shapes["rope_factors_short.weight"] = \
            (cfg.rot_dim // 2,)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (e,), p + "attn_output.weight": (q, e),
                       p + "ffn_norm.weight": (e,)})
        if cfg.fused_qkv:
            shapes[p + "attn_qkv.weight"] = (e, q + 2 * kv)
        else:
            shapes.update({p + "attn_q.weight": (e, q), p + "attn_k.weight": (e, kv),
                           p + "attn_v.weight": (e, kv)})
        if cfg.n_expert and i >= cfg.n_dense_lead:
            x, fe = cfg.n_expert, cfg.n_ff_exp
            shapes.update({p + "ffn_gate_inp.weight": (e, x), p + "ffn_gate_exps.weight": (e, fe, x),
                           p + "ffn_up_exps.weight": (e, fe, x),
                           p + "ffn_down_exps.weight": (fe, e, x)})
            if cfg.n_ff_shexp:
                s = cfg.n_ff_shexp
                shapes.update({p + "ffn_gate_shexp.weight": (e, s), p + "ffn_up_shexp.weight": (e, s),
                               p + "ffn_down_shexp.weight": (s, e)})
            if cfg.shexp_gate:
                shapes[p + "ffn_gate_inp_shexp.weight"] = (e,)
            if cfg.expert_bias:
                shapes[p + "exp_probs_b.bias"] = (x,)
            if cfg.arch == "gpt-oss":
                # router and expert biases, sinks, the output bias; its pre-FFN norm is
                # post_attention_norm (llama.cpp's attn_post_norm), there is no ffn_norm
                shapes.update({p + "ffn_gate_inp.bias": (x,), p + "ffn_gate_exps.bias": (fe, x),
                               p + "ffn_up_exps.bias": (fe, x), p + "ffn_down_exps.bias": (e, x),
                               p + "attn_sinks.weight": (cfg.n_head,), p + "attn_output.bias": (e,),
                               p + "post_attention_norm.weight": (e,)})
                del shapes[p + "ffn_norm.weight"]
        elif cfg.fused_up:
            shapes.update({p + "ffn_up.weight": (e, 2 * ff), p + "ffn_down.weight": (ff, e)})
        else:
            shapes.update({p + "ffn_gate.weight": (e, ff), p + "ffn_up.weight": (e, ff),
                           p + "ffn_down.weight": (ff, e)})
        if cfg.qk_norm:
            shapes[p + "attn_q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "attn_k_norm.weight"] = (cfg.head_dim,)
        if cfg.post_norms:
            shapes[p + "post_attention_norm.weight"] = (e,)
            shapes[p + "post_ffw_norm.weight"] = (e,)
        if cfg.qkv_bias:
            shapes[p + "attn_q.bias"] = (q,)
            shapes[p + "attn_k.bias"] = (kv,)
            shapes[p + "attn_v.bias"] = (kv,)
    return shapes


def _bert_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, ff = cfg.n_embd, cfg.n_ff
    nomic = cfg.arch == "nomic-bert"
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, cfg.vocab_size),
        "token_embd_norm.weight": (e,), "token_embd_norm.bias": (e,)}
    if not nomic:
        shapes["position_embd.weight"] = (e, cfg.context_length)
    if cfg.n_token_types:
        shapes["token_types.weight"] = (e, cfg.n_token_types)
    if cfg.n_cls_out:
        shapes["cls.output.weight"] = (e, cfg.n_cls_out)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        mats = [("attn_output", (cfg.q_dim, e)), ("ffn_up", (e, ff)), ("ffn_down", (ff, e))]
        if nomic:
            mats.append(("ffn_gate", (e, ff)))
        if cfg.fused_qkv:
            mats.append(("attn_qkv", (e, cfg.q_dim + 2 * cfg.kv_dim)))
        else:
            mats += [("attn_q", (e, cfg.q_dim)), ("attn_k", (e, cfg.kv_dim)),
                     ("attn_v", (e, cfg.kv_dim))]
        for n, shape in mats:
            shapes[p + n + ".weight"] = shape
        for n in ("attn_output_norm", "layer_output_norm"):
            shapes[p + n + ".weight"] = (e,)
            shapes[p + n + ".bias"] = (e,)
    return shapes


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    for name, shape in expected_tensors(cfg).items():
        t = f.tensors.get(name)
        if t is None:
            raise GGUFError(f"is missing tensor {name!r} required by the {cfg.arch} architecture")
        if tuple(t.shape) != shape:
            raise GGUFError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                            f"from the model's hyper-parameters")


@dataclass(frozen=True)
class ModelSummary:
    """What `edgeinfer show` and manifests print; works for any architecture."""
    path: str
    arch: str
    name: str
    n_params: int
    file_type: str
    quant_counts: dict[str, int]
    context_length: int | None
    n_layers: int | None
    n_head: int | None
    n_kv_head: int | None
    head_dim: int | None
    n_embd: int | None
    vocab_size: int
    tokenizer: str
    has_chat_template: bool
    file_size: int
    native: bool
    cpu_only: bool = False      # a mixture of experts: the native model is CPU-only


    @property
    def kv_bytes_per_token_f16(self) -> int | None:
        if None in (self.n_layers, self.n_kv_head, self.head_dim):
            return None
        return 2 * self.n_layers * self.n_kv_head * self.head_dim * 2


def file_type_name(ft) -> str:
    try:
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "unknown"


def summarize(f: GGUFFile) -> ModelSummary:
    md = f.metadata
    arch = str(md.get("general.architecture", "unknown"))

    def opt(key):
        v = md.get(f"{arch}.{key}")
        if hasattr(v, "__len__") and not isinstance(v, str):
            v = v[0] if len(v) else None
        return int(v) if v is not None else None

    n_head = opt("attention.head_count")
    n_embd = opt("embedding_length")
    head_dim = opt("attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    counts = Counter(t.type_name for t in f.tensors.values())
    ft = md.get("general.file_type")
    tokens = md.get("tokenizer.ggml.tokens")
    return ModelSummary(
        path=f.path, arch=arch, name=str(md.get("general.name", "")),
        n_params=sum(t.n_elements for t in f.tensors.values()),
        file_type=file_type_name(ft) if ft is not None else "unknown",
        quant_counts=dict(counts.most_common()),
        context_length=opt("context_length"), n_layers=opt("block_count"), n_head=n_head,
        n_kv_head=opt("attention.head_count_kv") or n_head, head_dim=head_dim, n_embd=n_embd,
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
        tokenizer=str(md.get("tokenizer.ggml.model", "none")),
        has_chat_template=isinstance(md.get("tokenizer.chat_template"), str),
        file_size=f.file_size, native=arch in NATIVE_ARCHS and native_reason(f) is None,
        cpu_only=cpu_only_file(f))
