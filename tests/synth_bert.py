"""A tiny synthetic BERT GGUF (random weights, a WordPiece vocabulary of a few hundred
tokens) in llama.cpp's layout, as an embedding model (mean or CLS pooling) or a reranker
(rank pooling with a classification head). Written with gguf.GGUFWriter in F32; tests/synth.py's
quantize() turns it into Q8_0 etc. with llama.cpp's own quantizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

N_EMBD, N_FF, N_HEAD, N_LAYERS, N_CTX = 256, 512, 4, 3, 512
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

WORDS = ("the a of and to in is it that was for on are with as his they be at one have this "
         "from or had by word but what some we can out other were all there when up use your "
         "how said an each she which do their time if will way about many then them write "
         "would like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side "
         "been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form "
         "sentence great think say help low line differ turn cause much mean before move right "
         "boy old too same tell does set three want air well also play small end put home read "
         "hand port large spell add even land here must big high such follow act why ask men "
         "change went light kind off need house picture try us again animal point mother world "
         "near build self earth father fox dog cat quick brown lazy jumps paris capital france "
         "vector embedding search model text local").split()
SUFFIXES = ("s", "ing", "ed", "er", "ly", "est", "tion")


def bert_vocab() -> tuple[list[str], list[int]]:
    """llama.cpp's converted WordPiece: [PAD] 0, [unusedN], [UNK] 100, [CLS] 101, [SEP] 102,
    [MASK] 103; word starts as "\u2581word", continuations ("##ing") bare."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    types = [3] + [5] * 99 + [3, 3, 3, 3]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    punct = list(".,!?;:'\"()-")
    seen = set(tokens)
    for t in ["\u2581" + w for w in WORDS] + ["\u2581" + c for c in chars + punct] + \
            chars + list(SUFFIXES):
        if t not in seen:
            seen.add(t)
            tokens.append(t)
            types.append(1)
    return tokens, types


def write_bert(path: Path, pooling: str = "mean", seed: int = 0, reranker: bool = False,
               n_cls_out: int = 1, arch: str = "bert") -> Path:
    """arch "bert" (absolute positions, GELU, separate q/k/v with biases) or "nomic-bert"
    (rotary positions, fused attn_qkv, SwiGLU, no biases in the matrices)."""
    rng = np.random.default_rng(seed)
    nomic = arch == "nomic-bert"
    w = GGUFWriter(str(path), arch)
    w.add_name("synthetic-bert-reranker" if reranker else "synthetic-bert")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_uint32(f"{arch}.pooling_type", POOLING["rank" if reranker else pooling])
    if nomic:
        w.add_rope_freq_base(1000.0)
    w.add_file_type(0)
    tokens, types = bert_vocab()
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_bos_token_id(101)
    w.add_unk_token_id(100)
    w.add_sep_token_id(102)
    w.add_pad_token_id(0)
    w.add_mask_token_id(103)
    w.add_add_sep_token(True)
    vocab = len(tokens)

    def mat(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    def vec(n: int, mean: float = 0.0, sd: float = 0.1) -> np.ndarray:
        return (mean + sd * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, N_EMBD)) * 0.5).astype(np.float32))
    w.add_tensor("token_types.weight", (rng.standard_normal((2, N_EMBD)) * 0.1).astype(np.float32))
    if not nomic:
        w.add_tensor("position_embd.weight",
                     (rng.standard_normal((N_CTX, N_EMBD)) * 0.3).astype(np.float32))
    w.add_tensor("token_embd_norm.weight", vec(N_EMBD, 1.0))
    w.add_tensor("token_embd_norm.bias", vec(N_EMBD))
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        if nomic:
            w.add_tensor(p + "attn_qkv.weight", mat(3 * N_EMBD, N_EMBD, 0.8))
        else:
            for n in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(p + n + ".weight", mat(N_EMBD, N_EMBD, 0.8))
                w.add_tensor(p + n + ".bias", vec(N_EMBD))
        w.add_tensor(p + "attn_output.weight", mat(N_EMBD, N_EMBD, 0.5))
        if not nomic:
            w.add_tensor(p + "attn_output.bias", vec(N_EMBD))
        w.add_tensor(p + "attn_output_norm.weight", vec(N_EMBD, 1.0))
        w.add_tensor(p + "attn_output_norm.bias", vec(N_EMBD))
        w.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
        if nomic:
            w.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD))
        else:
            w.add_tensor(p + "ffn_up.bias", vec(N_FF))
        w.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF, 0.5))
        if not nomic:
            w.add_tensor(p + "ffn_down.bias", vec(N_EMBD))
        w.add_tensor(p + "layer_output_norm.weight", vec(N_EMBD, 1.0))
        w.add_tensor(p + "layer_output_norm.bias", vec(N_EMBD))
    if reranker:
        w.add_tensor("cls.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor("cls.bias", vec(N_EMBD))
        w.add_tensor("cls.output.weight", mat(n_cls_out, N_EMBD, 2.0))
        w.add_tensor("cls.output.bias", vec(n_cls_out))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma_embedding(path: Path, seed: int = 0, dense: bool = True) -> Path:
    """A random-weight `gemma-embedding` (EmbeddingGemma) model: tests/synth.py's gemma3
    shapes and vocabulary, bidirectional, mean pooling, optional dense_2/dense_3 projections."""
    import synth
    from edgeinfer.formats.synthetic import spm_vocab
    rng = np.random.default_rng(seed)
    arch = "gemma-embedding"
    E, FF, H, KV, D, L = synth.N_EMBD, synth.N_FF, synth.N_HEAD, synth.N_KV, synth.HEAD_DIM, synth.N_LAYERS
    w = GGUFWriter(str(path), arch)
    w.add_name("synthetic-gemma-embedding")
    w.add_context_length(2048)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1000000.0)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    w.add_sliding_window(synth.SLIDING_WINDOW)
    w.add_causal_attention(False)
    w.add_uint32(f"{arch}.pooling_type", POOLING["mean"])
    w.add_file_type(0)
    tokens, scores, types = spm_vocab("gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    def mat(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((len(tokens), E)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(E))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(E))
        w.add_tensor(p + "attn_q.weight", mat(H * D, E, 0.7))
        w.add_tensor(p + "attn_k.weight", mat(KV * D, E, 0.7))
        w.add_tensor(p + "attn_v.weight", mat(KV * D, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * D, 0.3))
        w.add_tensor(p + "attn_q_norm.weight", norm(D))
        w.add_tensor(p + "attn_k_norm.weight", norm(D))
        w.add_tensor(p + "post_attention_norm.weight", norm(E))
        w.add_tensor(p + "ffn_norm.weight", norm(E))
        w.add_tensor(p + "ffn_gate.weight", mat(FF, E))
        w.add_tensor(p + "ffn_up.weight", mat(FF, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, FF, 0.3))
        w.add_tensor(p + "post_ffw_norm.weight", norm(E))
    if dense:
        w.add_uint32(f"{arch}.dense_2_feat_in", E)
        w.add_uint32(f"{arch}.dense_2_feat_out", 2 * E)
        w.add_uint32(f"{arch}.dense_3_feat_in", 2 * E)
        w.add_uint32(f"{arch}.dense_3_feat_out", E)
        w.add_tensor("dense_2.weight", mat(2 * E, E))
        w.add_tensor("dense_3.weight", mat(E, 2 * E))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
