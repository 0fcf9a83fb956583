"""Tiny random-weight vision projectors (mmproj GGUFs) in llama.cpp's clip layout, and a
Gemma 3 text model whose vocabulary has the image tags, for tests.

The layout is the one llama.cpp's tools/mtmd/clip.cpp reads for `clip.projector_type`
"gemma3": a SigLIP vision tower (`v.patch_embd`, `v.position_embd`, `v.blk.N.{attn_q,attn_k,
attn_v,attn_out,ln1,ln2,ffn_up,ffn_down}`, `v.post_ln`) and Gemma 3's projector
(`mm.soft_emb_norm.weight`, `mm.input_projection.weight`), with the `clip.vision.*` keys.
llama.cpp (libmtmd) loads the very same file, which is how the encoder's parity is tested.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFWriter
from gguf.quants import quantize

from edgeinfer.formats.synthetic import TinyShape, random_f32_tensors, write_tiny_gguf

# Gemma 3's image tags (llama.cpp's mtmd wraps each image's embeddings in them)
GEMMA3_IMAGE_TAGS = ("<start_of_image>", "<end_of_image>")


@dataclass(frozen=True)
class TinyVisionShape:
    n_embd: int = 64            # vision width
    n_ff: int = 128
    n_head: int = 4
    layers: int = 2
    image_size: int = 64        # pixels per side
    patch_size: int = 8         # -> 8 x 8 patches
    n_merge: int = 2            # avg-pool kernel: 4 x 4 = 16 image tokens


def write_tiny_mmproj(path: Path, n_embd_text: int, shape: TinyVisionShape = TinyVisionShape(),
                      seed: int = 0, f16: bool = False, swapped_ffn: bool = False,
                      projector: str = "gemma3", longest_edge: int = 0,
                      scale_key: bool = True, mlp_hidden: int = 96,
                      block_qtype: str | None = None) -> Path:
    """A Gemma 3 projector of `shape` for a text model of width `n_embd_text`
    (`swapped_ffn`: ffn_up / ffn_down under each other's names, as early conversions).
    projector="idefics3": SmolVLM's (pixel shuffle by n_merge, `mm.model.fc`), images cut
    into image_size tiles after scaling the longest edge to `longest_edge`. `scale_key=False`
    leaves clip.vision.projector.scale_factor out, as released Gemma 3 files do (4 then).
    projector="mlp": LLaVA 1.5's (a CLIP tower: class embedding, pre-LayerNorm, quick GELU,
    no patch bias or post-LayerNorm; mm.0 [width -> mlp_hidden], mm.2 [-> text width]).
    block_qtype ("Q8_0", "Q4_0", ...): the blocks' matrices in that ggml type, as quantized
    mmproj files keep them."""
    clip = projector == "mlp"
    rng = np.random.default_rng(seed)
    e, ff, p = shape.n_embd, shape.n_ff, shape.patch_size
    n_patches = (shape.image_size // p) ** 2
    dt = np.float16 if f16 else np.float32

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(dt)

    def vec(n: int, center: float = 0.0, spread: float = 0.1) -> np.ndarray:
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(str(path), "clip")

    def add_block_mat(name: str, m: np.ndarray) -> None:
        if block_qtype is None:
            w.add_tensor(name, m)
            return
        qt = gguf.GGMLQuantizationType[block_qtype]
        w.add_tensor(name, quantize(m.astype(np.float32), qt), raw_dtype=qt)
    w.add_name("synthetic-gemma3-mmproj")
    w.add_file_type(1 if f16 else 0)
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", False)
    w.add_bool("clip.use_gelu", not clip)
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.block_count", shape.layers)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if scale_key:
        w.add_uint32("clip.vision.projector.scale_factor", shape.n_merge)
    if longest_edge:
        w.add_uint32("clip.vision.preproc_image_size", longest_edge)
    # conv weights [out, in, kh, kw] (ggml: kw, kh, in, out), f16 as in released files
    w.add_tensor("v.patch_embd.weight",
                 (rng.standard_normal((e, 3, p, p)) / np.sqrt(3 * p * p)).astype(np.float16))
    if not clip:
        w.add_tensor("v.patch_embd.bias", vec(e))
    else:
        w.add_tensor("v.class_embd", vec(e, 0.0, 0.5))
        w.add_tensor("v.pre_ln.weight", vec(e, 1.0))
        w.add_tensor("v.pre_ln.bias", vec(e))
    # f32 always: ggml adds it to the f32 patch embeddings (no f32 + f16 add on the CPU)
    w.add_tensor("v.position_embd.weight",
                 (0.5 * rng.standard_normal((n_patches + int(clip), e))).astype(np.float32))
    for i in range(shape.layers):
        b = f"v.blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v"):
            add_block_mat(b + n + ".weight", mat(e, e))
            w.add_tensor(b + n + ".bias", vec(e))
        add_block_mat(b + "attn_out.weight", mat(e, e, 0.5))
        w.add_tensor(b + "attn_out.bias", vec(e))
        w.add_tensor(b + "ln1.weight", vec(e, 1.0))
        w.add_tensor(b + "ln1.bias", vec(e))
        w.add_tensor(b + "ln2.weight", vec(e, 1.0))
        w.add_tensor(b + "ln2.bias", vec(e))
        up, down = ("ffn_down", "ffn_up") if swapped_ffn else ("ffn_up", "ffn_down")
        add_block_mat(b + up + ".weight", mat(ff, e))
        w.add_tensor(b + up + ".bias", vec(ff))
        add_block_mat(b + down + ".weight", mat(e, ff, 0.5))
        w.add_tensor(b + down + ".bias", vec(e))
    if not clip:
        w.add_tensor("v.post_ln.weight", vec(e, 1.0))
        w.add_tensor("v.post_ln.bias", vec(e))
    if clip:
        w.add_tensor("mm.0.weight", mat(mlp_hidden, e))
        w.add_tensor("mm.0.bias", vec(mlp_hidden))
        w.add_tensor("mm.2.weight", mat(n_embd_text, mlp_hidden, 2.0))
        w.add_tensor("mm.2.bias", vec(n_embd_text))
    elif projector == "idefics3":
        k = e * shape.n_merge ** 2          # pixel-shuffled width -> text width
        w.add_tensor("mm.model.fc.weight",
                     (rng.standard_normal((n_embd_text, k)) * 2.0 / np.sqrt(k)).astype(dt))
    else:
        w.add_tensor("mm.soft_emb_norm.weight", vec(e, 1.0))
        # Gemma 3's projection is stored [vision width, text width] (ggml ne0 = text width)
        w.add_tensor("mm.input_projection.weight",
                     (rng.standard_normal((e, n_embd_text)) * 4.0 / np.sqrt(e)).astype(dt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma3_vision_text(path: Path, seed: int = 0) -> Path:
    """tests/synth.py's Gemma 3 text model with <start_of_image> / <end_of_image> in its
    vocabulary (control tokens), as the vision-capable Gemma 3 models have."""
    tensor = random_f32_tensors(np.random.default_rng(seed))

    shape = TinyShape(256, 512, 4, 2, 64, 7, 2048, 32)
    return write_tiny_gguf(path, "gemma3", shape, tensor, file_type=0,
                           name="synthetic-gemma3-vision", space_prefix=False,
                           extra_specials=GEMMA3_IMAGE_TAGS)


# SmolVLM's (Idefics3) image tokens: each tile after "<fake_token_around_image><row_R_col_C>",
# rows ended by "\n", the overview after "\n\n<fake_token_around_image><global-img>" and
# before "<fake_token_around_image>"
IDEFICS3_SPECIALS = ("<fake_token_around_image>", "<global-img>") + tuple(
    f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))


def write_smolvlm_text(path: Path, seed: int = 0) -> Path:
    """A llama-architecture text model with a byte-level BPE vocabulary holding SmolVLM's
    image tokens and single "\n" / "\n\n" tokens (libmtmd looks them up by their text)."""
    tensor = random_f32_tensors(np.random.default_rng(seed))

    shape = TinyShape(256, 512, 4, 2, 64, 4, 2048)
    return write_tiny_gguf(path, "llama", shape, tensor, file_type=0,
                           name="synthetic-smolvlm-text", bpe=True, bpe_pre="smollm",
                           extra_specials=IDEFICS3_SPECIALS, extra_merges=("Ċ Ċ",))


def write_tiny_pixtral(path: Path, n_embd_text: int, seed: int = 0, n_embd: int = 64,
                       n_ff: int = 128, n_head: int = 4, layers: int = 2, patch: int = 8,
                       merge: int = 2, hidden: int = 96, f16: bool = False) -> Path:
    """A Pixtral / Mistral Small 3.1 projector (pixtral): RMSNorm + SwiGLU blocks (no
    biases, no learned positions), a patch merger of merge x merge, mm.1 / mm.2 and the
    [IMG_BREAK] embedding."""
    rng = np.random.default_rng(seed)
    e, ff = n_embd, n_ff
    dt = np.float16 if f16 else np.float32

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(dt)

    def vec(n: int, center: float = 0.0, spread: float = 0.1) -> np.ndarray:
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(str(path), "clip")
    w.add_name("synthetic-pixtral-mmproj")
    w.add_file_type(1 if f16 else 0)
    w.add_string("clip.projector_type", "pixtral")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_silu", True)
    w.add_uint32("clip.vision.image_size", 128)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    w.add_uint32("clip.vision.spatial_merge_size", merge)
    w.add_tensor("v.patch_embd.weight",
                 (rng.standard_normal((e, 3, patch, patch)) / np.sqrt(3 * patch * patch)
                  ).astype(np.float16))
    w.add_tensor("v.pre_ln.weight", vec(e, 1.0))
    for i in range(layers):
        b = f"v.blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(b + n + ".weight", mat(e, e))
        w.add_tensor(b + "attn_out.weight", mat(e, e, 0.5))
        w.add_tensor(b + "ln1.weight", vec(e, 1.0))
        w.add_tensor(b + "ln2.weight", vec(e, 1.0))
        w.add_tensor(b + "ffn_gate.weight", mat(ff, e))
        w.add_tensor(b + "ffn_up.weight", mat(ff, e))
        w.add_tensor(b + "ffn_down.weight", mat(e, ff, 0.5))
    w.add_tensor("mm.input_norm.weight", vec(e, 1.0))
    w.add_tensor("mm.patch_merger.weight", mat(e, e * merge * merge))
    w.add_tensor("mm.1.weight", mat(hidden, e))
    w.add_tensor("mm.1.bias", vec(hidden))
    w.add_tensor("mm.2.weight", mat(n_embd_text, hidden, 2.0))
    w.add_tensor("mm.2.bias", vec(n_embd_text))
    w.add_tensor("v.token_embd.img_break", vec(n_embd_text, 0.0, 1.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_pixtral_text(path: Path, seed: int = 0) -> Path:
    """A llama text model whose vocabulary has [IMG_END] (Pixtral's end-of-image tag)."""
    tensor = random_f32_tensors(np.random.default_rng(seed))

    return write_tiny_gguf(path, "llama", TinyShape(256, 512, 4, 2, 64, 4, 2048), tensor,
                           file_type=0, name="synthetic-pixtral-text", space_prefix=True,
                           extra_specials=("[IMG_END]",))
