"""Tiny synthetic GGUF models (random weights) for llama, qwen2, qwen3 and gemma3.

Written in F32 with `gguf.GGUFWriter`, then quantized with llama.cpp's own quantizer, so each
architecture and quant type is covered in seconds and llama.cpp can run the very same file.
Dimensions are multiples of 256 so k-quants apply to every matrix.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

FTYPES = {"F32": 0, "Q8_0": 7, "Q5_0": 8, "Q4_K_M": 15, "Q6_K": 18}

N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM, N_LAYERS = 256, 512, 4, 2, 64, 7
SLIDING_WINDOW = 32


def _spm_vocab(arch: str) -> tuple[list[str], list[float], list[int]]:
    if arch == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    else:
        specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)]
    types = [3] * len(specials) + [6] * 256
    types[specials.index("<unk>")] = 2
    words = ["▁", "▁the", "▁a", "▁of", "▁and", "e", "t", "a", "o", "n", "th", "he", "in", "er",
             "▁is", "▁to", "s", "r", "▁in", "an"]
    words += [f"▁w{i}" for i in range(384 - len(tokens) - len(words))]
    scores = [0.0] * (len(tokens)) + [-float(i) for i in range(len(words))]
    return tokens + words, scores, types + [1] * len(words)


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    # GPT-2 byte-to-unicode alphabet, then a few merges.
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
    merged = [m.replace(" ", "") for m in merges]
    tokens = alphabet + merged
    tokens += [f"tok{i}" for i in range(381 - len(tokens))]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, types, merges


def write_model(path: Path, arch: str, seed: int = 0) -> Path:
    """A random-weight F32 model of the given architecture."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(2048)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(10000.0 if arch != "qwen2" else 1000000.0)
    w.add_file_type(0)
    if arch == "gemma3":
        w.add_sliding_window(SLIDING_WINDOW)
    if arch in ("llama", "gemma3"):
        tokens, scores, types = _spm_vocab(arch)
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
        w.add_add_space_prefix(arch == "llama")
    else:
        tokens, types, merges = _bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_add_bos_token(False)
    vocab = len(tokens)

    # Scales keep the random network well conditioned (small residual branches, soft
    # attention): a chaotic one would amplify llama.cpp's 8-bit activation rounding into
    # different argmaxes, and the parity tests would measure chaos instead of the engine.
    def mat(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, N_EMBD)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(N_EMBD))
    if arch != "gemma3":
        w.add_tensor("output.weight", mat(vocab, N_EMBD, 4.0))
    q, kv = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(N_EMBD))
        w.add_tensor(p + "attn_q.weight", mat(q, N_EMBD, 0.7))
        w.add_tensor(p + "attn_k.weight", mat(kv, N_EMBD, 0.7))
        w.add_tensor(p + "attn_v.weight", mat(kv, N_EMBD))
        w.add_tensor(p + "attn_output.weight", mat(N_EMBD, q, 0.3))
        w.add_tensor(p + "ffn_norm.weight", norm(N_EMBD))
        w.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF, 0.3))
        if arch in ("gemma3", "qwen3"):
            w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(N_EMBD))
            w.add_tensor(p + "post_ffw_norm.weight", norm(N_EMBD))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", (0.1 * rng.standard_normal(q)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.1 * rng.standard_normal(kv)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.1 * rng.standard_normal(kv)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """Quantize with llama.cpp's own quantizer (llama_model_quantize)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed with {rc}")
    return dst


def synthetic_model(cache: Path, arch: str, ftype: str) -> Path:
    """Build (once per cache dir) a synthetic model of arch quantized to ftype."""
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"synth-{arch}-{ftype}.gguf"
    if not out.exists():
        f32 = cache / f"synth-{arch}-F32.gguf"
        if not f32.exists():
            write_model(f32.with_suffix(".tmp"), arch).rename(f32)
        if ftype == "F32":
            return f32
        quantize(f32, out.with_suffix(".tmp"), ftype).rename(out)
    return out
