"""Tiny random-weight GGUF files of the native architectures (llama, qwen2, qwen3, gemma3).

One writer for the kernel warm-up (edgeinfer/engine/warmup.py runs such a model through the
engine) and the tests (tests/synth.py: F32, then llama.cpp's quantizer): the metadata, the
tokenizer of each family and the tensor layout live here; the caller says how a tensor's
values are made (`TensorFn`), so the draws of its generator stay its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFWriter

# (name, kind, shape, scale) -> the tensor to write, and its raw GGML type (None: from dtype).
# kind: "embd" (token embeddings), "mat" (a weight matrix [out, in]), "norm", "bias".
TensorFn = Callable[[str, str, tuple[int, int] | tuple[int], float],
                    tuple[np.ndarray, object | None]]


def random_f32_tensors(rng: np.random.Generator) -> TensorFn:
    """The well-conditioned random F32 weights every synthetic model writes (small residual
    branches, soft attention): a chaotic network would amplify llama.cpp's 8-bit activation
    rounding into different argmaxes, and parity tests would measure chaos, not the engine."""
    def tensor(name: str, kind: str, dims: tuple, scale: float):
        if kind == "embd":
            return (rng.standard_normal(dims) * 0.5).astype(np.float32), None
        if kind == "mat":
            return (rng.standard_normal(dims) * scale / np.sqrt(dims[1])).astype(np.float32), None
        if kind == "norm":
            return (1.0 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32), None
        return (0.1 * rng.standard_normal(dims[0])).astype(np.float32), None
    return tensor


@dataclass(frozen=True)
class TinyShape:
    n_embd: int
    n_ff: int
    n_head: int
    n_kv: int
    head_dim: int
    layers: int
    context: int
    sliding_window: int = 32          # gemma3's local layers


def spm_vocab(arch: str, extra_specials: tuple[str, ...] = ()
              ) -> tuple[list[str], list[float], list[int]]:
    """A 384-token SentencePiece vocabulary with the family's specials and byte tokens
    (`extra_specials`: more control tokens after the family's, e.g. Gemma 3's image tags)."""
    if arch == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    else:
        specials = ["<unk>", "<s>", "</s>"]
    specials += list(extra_specials)
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)]
    types = [3] * len(specials) + [6] * 256
    types[specials.index("<unk>")] = 2
    words = ["▁", "▁the", "▁a", "▁of", "▁and", "e", "t", "a", "o", "n", "th", "he", "in", "er",
             "▁is", "▁to", "s", "r", "▁in", "an"]
    words += [f"▁w{i}" for i in range(384 - len(tokens) - len(words))]
    scores = [0.0] * (len(tokens)) + [-float(i) for i in range(len(words))]
    return tokens + words, scores, types + [1] * len(words)


def bpe_vocab(extra_specials: tuple[str, ...] = (), extra_merges: tuple[str, ...] = ()
              ) -> tuple[list[str], list[int], list[str]]:
    """A 384-token GPT-2 byte-level vocabulary (the byte-to-unicode alphabet, a few merges,
    ChatML specials last; `extra_specials`, control tokens, just before them)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for c in cs]
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t"]
    merges += list(extra_merges)
    merged = [m.replace(" ", "") for m in merges]
    tokens = alphabet + merged
    tokens += [f"tok{i}" for i in range(381 - len(extra_specials) - len(tokens))]
    tokens += list(extra_specials) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3 - len(extra_specials)) + [3] * (3 + len(extra_specials))
    return tokens, types, merges


def write_tiny_gguf(path: Path, arch: str, shape: TinyShape, tensor: TensorFn, *,
                    file_type: int, rope_base: float = 10000.0, name: str | None = None,
                    space_prefix: bool | None = None, chat_template: str | None = None,
                    extra_specials: tuple[str, ...] = (), bpe: bool | None = None,
                    extra_merges: tuple[str, ...] = (), bpe_pre: str = "qwen2") -> Path:
    """Write a model of `arch` whose tensors `tensor` makes, in llama.cpp's tensor order.
    `bpe`: the byte-level BPE vocabulary (default: for qwen2/qwen3 only; SentencePiece for
    llama and gemma3), with `extra_merges` and pre-tokenizer `bpe_pre`."""
    if bpe is None:
        bpe = arch not in ("llama", "gemma3")
    w = GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_file_type(file_type)
    if arch == "gemma3":
        w.add_sliding_window(shape.sliding_window)
    if not bpe:
        tokens, scores, types = spm_vocab(arch, extra_specials)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        if arch == "gemma3":
            w.add_bos_token_id(2); w.add_eos_token_id(1); w.add_unk_token_id(3); w.add_pad_token_id(0)
        else:
            w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        if space_prefix is not None:
            w.add_add_space_prefix(space_prefix)
    else:
        tokens, types, merges = bpe_vocab(extra_specials, extra_merges)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(bpe_pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    vocab, e = len(tokens), shape.n_embd

    def add(name: str, kind: str, dims: tuple, scale: float = 1.0) -> None:
        data, raw = tensor(name, kind, dims, scale)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", "embd", (vocab, e))
    add("output_norm.weight", "norm", (e,))
    if arch != "gemma3":
        add("output.weight", "mat", (vocab, e), 4.0)
    q, kv, ff, hd = shape.n_head * shape.head_dim, shape.n_kv * shape.head_dim, shape.n_ff, \
        shape.head_dim
    for i in range(shape.layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", "norm", (e,))
        add(p + "attn_q.weight", "mat", (q, e), 0.7)
        add(p + "attn_k.weight", "mat", (kv, e), 0.7)
        add(p + "attn_v.weight", "mat", (kv, e))
        add(p + "attn_output.weight", "mat", (e, q), 0.3)
        add(p + "ffn_norm.weight", "norm", (e,))
        add(p + "ffn_gate.weight", "mat", (ff, e))
        add(p + "ffn_up.weight", "mat", (ff, e))
        add(p + "ffn_down.weight", "mat", (e, ff), 0.3)
        if arch in ("gemma3", "qwen3"):
            add(p + "attn_q_norm.weight", "norm", (hd,))
            add(p + "attn_k_norm.weight", "norm", (hd,))
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", "norm", (e,))
            add(p + "post_ffw_norm.weight", "norm", (e,))
        if arch == "qwen2":
            add(p + "attn_q.bias", "bias", (q,))
            add(p + "attn_k.bias", "bias", (kv,))
            add(p + "attn_v.bias", "bias", (kv,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
