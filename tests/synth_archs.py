"""Tiny random GGUF files of phi3, smollm3, mistral3, qwen3moe and gpt-oss in llama.cpp's layout.

Metadata keys and tensor names/shapes as llama.cpp's converter writes them (ggml shapes:
`attn_qkv` [E, q + 2 kv], phi3's `ffn_up` [E, 2 n_ff] gate rows first, `rope_factors_long` /
`rope_factors_short` [n_rot / 2], qwen3moe's `ffn_gate_inp` [E, X] and `ffn_{gate,up}_exps`
[E, F, X], `ffn_down_exps` [F, E, X]; gpt-oss's q/k/v/o biases, `attn_sinks` [H], router
bias [X] and expert biases [F, X] / [E, X], `post_attention_norm` in place of `ffn_norm`). Written in F32 (numpy arrays in row-major order: the
last axis is ggml's first), then quantized with llama.cpp's own quantizer (synth.quantize).
Vocabularies come from edgeinfer/formats/synthetic.py. Dimensions are multiples of 256.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from build_once import build_once
from edgeinfer.formats.synthetic import bpe_vocab, spm_vocab


@dataclass(frozen=True)
class Variant:
    arch: str
    layers: int = 4
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_kv: int = 2
    head_dim: int = 64
    n_rot: int = 64
    bpe: bool = True
    tied: bool = False
    rope_base: float = 10000.0
    context: int = 4096
    # phi3 LongRoPE
    long_rope: bool = False
    attn_factor: float = 1.0
    orig_ctx: int = 0
    # mistral3
    yarn_factor: float = 0.0
    temp_scale: float = 0.0
    yarn_log_mul: float = 0.0
    # qwen3moe
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    # gpt-oss: sliding window on alternate layers (attention.sliding_window)
    sliding_window: int = 0
    # qwen2moe: q/k/v biases and a shared expert of this width (gated by ffn_gate_inp_shexp)
    qkv_bias: bool = False
    n_ff_shexp: int = 0
    seed: int = 0           # the random weights' (variant_model)
    # dots1: leading dense layers, shared experts (a count), gating 1/2 (softmax/sigmoid),
    # weights normalized and scaled, the selection bias exp_probs_b; the router's scale
    n_dense_lead: int = 0
    n_shared: int = 0
    gating: int = 0
    weights_norm: bool = False
    weights_scale: float = 0.0
    probs_bias: bool = False
    router_scale: float = 6.0


VARIANTS = {
    # Phi-3.5-mini's shape: full rotary, MHA, LongRoPE factors + attn_factor, SPM vocabulary
    "phi3": Variant("phi3", n_kv=4, bpe=False, long_rope=True, attn_factor=1.19,
                    orig_ctx=4096, context=131072),
    # Phi-4-mini's: GQA, partial rotary (0.75 of the head), tied output (its byte-level BPE
    # vocabulary is left out: libllama refuses our tiny BPE one for phi3)
    "phi3-mini4": Variant("phi3", n_rot=48, tied=True, bpe=False, long_rope=True, attn_factor=1.19,
                          orig_ctx=4096, context=131072, rope_base=10000.0),
    # SmolLM3's: NoPE every 4th layer (8 layers: 3 and 7), GQA, BPE, tied
    "smollm3": Variant("smollm3", layers=8, tied=True, rope_base=5e6, context=65536),
    # Ministral 3's: YaRN x16 and attention temperature past the original context (64 here,
    # so that the test's positions cross it)
    "mistral3": Variant("mistral3", rope_base=1e6, yarn_factor=16.0, orig_ctx=64,
                        temp_scale=0.1, context=1024),
    # with rope.scaling.yarn_log_multiplier (HF mscale_all_dim = 1, as Ministral 3 ships)
    "mistral3-logmul": Variant("mistral3", rope_base=1e6, yarn_factor=16.0, orig_ctx=64,
                               temp_scale=0.1, yarn_log_mul=1.0, context=1024),
    # Qwen3-30B-A3B's structure scaled down: 16 experts, 4 used, QK-norm, no shared expert
    "qwen3moe": Variant("qwen3moe", n_ff=768, rope_base=1e6, n_expert=16, n_expert_used=4,
                        n_ff_exp=256, context=4096),
    # Qwen3-30B-A3B's routing width: 128 experts, 8 used (narrow experts: Q8_0 / F32 only)
    "qwen3moe-128": Variant("qwen3moe", layers=2, n_ff=768, rope_base=1e6, n_expert=128,
                            n_expert_used=8, n_ff_exp=64, context=4096),
    # benchmarks/moe.py: Qwen3-30B-A3B's routing (128 experts, 8 used, GQA 8:1 with QK-norm)
    # at a width this machine holds (1.6 GB in F32, ~0.3 GB at Q4_K_M)
    # gpt-oss-20b's structure scaled down: GQA with q wider than the hidden size, sinks,
    # biases, a 24-token window on even layers (the test's 40-token prefill crosses it), YaRN
    # x32 from an original context of 64 (crossed too), 16 experts of which 4 are used
    "gpt-oss": Variant("gpt-oss", n_head=8, n_kv=2, n_ff=256, rope_base=150000.0,
                       yarn_factor=32.0, orig_ctx=64, n_expert=16, n_expert_used=4,
                       n_ff_exp=256, sliding_window=24, context=2048),
    # a gpt-oss at a width this machine holds for timing against llama.cpp (0.9 GB in F32,
    # ~0.13 GB as MXFP4_MOE): 8 layers of 768, 16 experts of 768, 4 used, a 128-token window
    "gpt-oss-bench": Variant("gpt-oss", layers=8, n_embd=768, n_head=12, n_kv=2, n_ff=768,
                             rope_base=150000.0, yarn_factor=32.0, orig_ctx=4096,
                             n_expert=16, n_expert_used=4, n_ff_exp=768, sliding_window=128,
                             context=8192),
    # Mixtral's structure scaled down: arch llama with 8 experts of which 2 are used (its
    # experts' width is feed_forward_length), llama rope, GQA
    "mixtral": Variant("llama", n_ff=256, rope_base=1e6, n_expert=8, n_expert_used=2,
                       n_ff_exp=256, context=4096, seed=1),
    # Qwen1.5-MoE-A2.7B's: q/k/v biases, 16 routed experts of 256 (4 used, weights not
    # renormalized), a shared expert 4 times as wide gated by sigmoid(h . gate_inp_shexp)
    "qwen2moe": Variant("qwen2moe", n_ff=512, rope_base=1e6, n_expert=16, n_expert_used=4,
                        n_ff_exp=256, qkv_bias=True, n_ff_shexp=1024, context=4096),
    # dots.llm1's structure: QK-norm, MHA (llama.cpp's dots1 gives K and V all the heads),
    # a leading dense layer, sigmoid gating whose top k is chosen with a bias, weights
    # normalized then scaled by 2.5, one shared expert of the experts' width (router logits
    # of +-3 gave sigmoid probabilities so close that quantization flipped choices; at +-6
    # the choice among the saturated ones is the bias's)
    "dots1": Variant("dots1", n_kv=4, n_ff=512, rope_base=1e6, n_expert=16, n_expert_used=4,
                     n_ff_exp=256, n_dense_lead=1, n_shared=1, gating=2, weights_norm=True,
                     weights_scale=2.5, probs_bias=True, context=4096),
    "qwen3moe-bench": Variant("qwen3moe", layers=8, n_embd=512, n_ff=768, n_head=8, n_kv=1,
                              rope_base=1e6, n_expert=128, n_expert_used=8, n_ff_exp=256,
                              context=4096),
}


def write_variant(path: Path, name: str, seed: int = 0, extra_u32: dict | None = None,
                  extra_f32: dict | None = None) -> Path:
    """Write the variant; `extra_u32` / `extra_f32`: more metadata (key -> value), e.g. a
    gating function the native engine does not implement."""
    from gguf import GGUFWriter
    v = VARIANTS[name]
    arch = v.arch
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{name}")
    w.add_context_length(v.context)
    w.add_embedding_length(v.n_embd)
    w.add_block_count(v.layers)
    w.add_feed_forward_length(v.n_ff)
    w.add_head_count(v.n_head)
    w.add_head_count_kv(v.n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(v.head_dim)
    w.add_value_length(v.head_dim)
    w.add_rope_dimension_count(v.n_rot)
    w.add_rope_freq_base(v.rope_base)
    w.add_file_type(0)
    if v.long_rope:
        w.add_rope_scaling_attn_factors(v.attn_factor)
        w.add_rope_scaling_orig_ctx_len(v.orig_ctx)
    if v.yarn_factor:
        from gguf import RopeScalingType
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(v.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(v.orig_ctx)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        if v.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(v.yarn_log_mul)
    if v.temp_scale:
        w.add_attn_temperature_scale(v.temp_scale)
    if v.sliding_window:
        w.add_sliding_window(v.sliding_window)
    if v.n_expert:
        w.add_expert_count(v.n_expert)
        w.add_expert_used_count(v.n_expert_used)
        if arch != "llama":     # Mixtral's converter writes none: its experts are n_ff wide
            w.add_expert_feed_forward_length(v.n_ff_exp)
    if v.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(v.n_ff_shexp)
    if arch == "dots1":
        w.add_leading_dense_block_count(v.n_dense_lead)
        w.add_expert_shared_count(v.n_shared)
        w.add_expert_weights_scale(v.weights_scale)
        w.add_expert_weights_norm(v.weights_norm)
        w.add_uint32(f"{arch}.expert_gating_func", v.gating)
    for key, val in (extra_u32 or {}).items():
        w.add_uint32(key, val)
    for key, val in (extra_f32 or {}).items():
        w.add_float32(key, val)
    if v.bpe:
        tokens, types, merges = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_add_bos_token(False)
    else:
        # Phi-3's control tokens: llama.cpp's vocabulary loader looks <|end|> up for phi3
        tokens, scores, types = spm_vocab("llama", ("<|endoftext|>", "<|assistant|>",
                                                    "<|end|>", "<|user|>", "<|system|>"))
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
    vocab, e = len(tokens), v.n_embd
    q, kv, ff, hd = v.n_head * v.head_dim, v.n_kv * v.head_dim, v.n_ff, v.head_dim

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, e)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(e))
    if not v.tied:
        w.add_tensor("output.weight", mat(vocab, e, 4.0))
    if v.long_rope:
        # LongRoPE factors: >= 1, growing with the dimension, as Phi-3.5's short_factor does
        half = v.n_rot // 2
        w.add_tensor("rope_factors_long.weight",
                     np.linspace(1.0, 40.0, half).astype(np.float32))
        w.add_tensor("rope_factors_short.weight",
                     (1.0 + np.linspace(0.0, 1.5, half) ** 2).astype(np.float32))
    for i in range(v.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(e))
        if arch == "phi3":
            w.add_tensor(p + "attn_qkv.weight", np.concatenate(
                [mat(q, e, 0.7), mat(kv, e, 0.7), mat(kv, e)]))
        else:
            w.add_tensor(p + "attn_q.weight", mat(q, e, 0.7))
            w.add_tensor(p + "attn_k.weight", mat(kv, e, 0.7))
            w.add_tensor(p + "attn_v.weight", mat(kv, e))
        w.add_tensor(p + "attn_output.weight", mat(e, q, 0.3))
        if v.qkv_bias:
            for n, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(p + n + ".bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if arch == "gpt-oss":
            for n, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", e)):
                w.add_tensor(p + n + ".bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
            # sink logits of the size of the scores: they take a real share of the softmax
            w.add_tensor(p + "attn_sinks.weight", (2.0 * rng.standard_normal(v.n_head)).astype(np.float32))
        if arch in ("qwen3moe", "dots1"):
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        # gpt-oss's pre-FFN norm is named post_attention_norm (llama.cpp's attn_post_norm)
        w.add_tensor(p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight"),
                     norm(e))
        if v.n_expert and i >= v.n_dense_lead:
            X, F = v.n_expert, v.n_ff_exp
            # router logits a few units apart: routing decided by the weights, not by rounding
            w.add_tensor(p + "ffn_gate_inp.weight", mat(X, e, v.router_scale))
            # gpt-oss: gate and up a few units wide, so its SwiGLU's clamp at 7 is reached
            gu = 2.0 if arch == "gpt-oss" else 1.0
            w.add_tensor(p + "ffn_gate_exps.weight", np.stack([mat(F, e, gu) for _ in range(X)]))
            w.add_tensor(p + "ffn_up_exps.weight", np.stack([mat(F, e, gu) for _ in range(X)]))
            w.add_tensor(p + "ffn_down_exps.weight", np.stack([mat(e, F, 0.3) for _ in range(X)]))
            if v.probs_bias:        # of the size of the probabilities' gaps: it moves choices
                w.add_tensor(p + "exp_probs_b.bias", (0.05 * rng.standard_normal(X)).astype(np.float32))
            if v.n_shared:
                S = F * v.n_shared
                w.add_tensor(p + "ffn_gate_shexp.weight", mat(S, e))
                w.add_tensor(p + "ffn_up_shexp.weight", mat(S, e))
                w.add_tensor(p + "ffn_down_shexp.weight", mat(e, S, 0.3))
            if v.n_ff_shexp:
                S = v.n_ff_shexp
                # the gate's logit a unit or two either side of 0: sigmoid far from 0 and 1
                w.add_tensor(p + "ffn_gate_inp_shexp.weight",
                             (1.5 * rng.standard_normal(e) / np.sqrt(e)).astype(np.float32))
                w.add_tensor(p + "ffn_gate_shexp.weight", mat(S, e))
                w.add_tensor(p + "ffn_up_shexp.weight", mat(S, e))
                w.add_tensor(p + "ffn_down_shexp.weight", mat(e, S, 0.3))
            if arch == "gpt-oss":
                bias = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
                w.add_tensor(p + "ffn_gate_inp.bias", bias(X))
                w.add_tensor(p + "ffn_gate_exps.bias", bias(X, F))
                w.add_tensor(p + "ffn_up_exps.bias", bias(X, F))
                w.add_tensor(p + "ffn_down_exps.bias", bias(X, e))
        elif arch == "phi3":
            w.add_tensor(p + "ffn_up.weight", np.concatenate([mat(ff, e), mat(ff, e)]))
            w.add_tensor(p + "ffn_down.weight", mat(e, ff, 0.3))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(ff, e))
            w.add_tensor(p + "ffn_up.weight", mat(ff, e))
            w.add_tensor(p + "ffn_down.weight", mat(e, ff, 0.3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def variant_model(cache: Path, name: str, ftype: str) -> Path:
    """Build (once per cache dir) the variant quantized to ftype (F32: unquantized)."""
    from synth import quantize
    cache.mkdir(parents=True, exist_ok=True)
    f32 = build_once(cache / f"synth-{name}-F32.gguf",
                     lambda tmp: write_variant(tmp, name, VARIANTS[name].seed))
    if ftype == "F32":
        return f32
    return build_once(cache / f"synth-{name}-{ftype}.gguf", lambda tmp: quantize(f32, tmp, ftype))
