"""Synthetic vision test data: a tiny Gemma 3 text model with the image tags, its mmproj in
llama.cpp's clip layout (edgeinfer/formats/synthetic_vision.py), and small test images."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from edgeinfer.formats.synthetic_vision import write_gemma3_vision_text, write_tiny_mmproj


def vision_pair(directory: Path) -> tuple[Path, Path]:
    """(text model, mmproj) written once into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "gemma3-vision-text.gguf", directory / "gemma3-mmproj.gguf"
    if not text.exists():
        write_gemma3_vision_text(text.with_suffix(".tmp")).rename(text)
    if not mmproj.exists():
        write_tiny_mmproj(mmproj.with_suffix(".tmp"), 256).rename(mmproj)
    return text, mmproj


def noise_rgb(h: int, w: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png_bytes(rgb: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, fmt)
    return buf.getvalue()


def smolvlm_pair(directory: Path) -> tuple[Path, Path]:
    """(llama text model with SmolVLM's image tokens, Idefics3 mmproj: 64 px tiles, 8 px
    patches, pixel shuffle 2 -> 16 tokens a tile, longest edge 128 -> up to 2x2 tiles)."""
    from edgeinfer.formats.synthetic_vision import write_smolvlm_text
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "smolvlm-text.gguf", directory / "smolvlm-mmproj.gguf"
    if not text.exists():
        write_smolvlm_text(text.with_suffix(".tmp")).rename(text)
    if not mmproj.exists():
        write_tiny_mmproj(mmproj.with_suffix(".tmp"), 256, projector="idefics3",
                          longest_edge=128, seed=3).rename(mmproj)
    return text, mmproj


def llava_pair(directory: Path) -> tuple[Path, Path]:
    """(tests/synth.py's llama text model, a LLaVA 1.5 "mlp" mmproj: CLIP tower of 3 layers
    (2 run), 64 px, 8 px patches -> 64 image tokens)."""
    import synth
    from edgeinfer.formats.synthetic_vision import TinyVisionShape
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "llava-text.gguf", directory / "llava-mmproj.gguf"
    if not text.exists():
        synth.write_model(text.with_suffix(".tmp"), "llama").rename(text)
    if not mmproj.exists():
        write_tiny_mmproj(mmproj.with_suffix(".tmp"), 256, TinyVisionShape(layers=3),
                          projector="mlp", seed=5).rename(mmproj)
    return text, mmproj


def pixtral_pair(directory: Path) -> tuple[Path, Path]:
    """(llama text model with [IMG_END], a Pixtral / Mistral Small 3.1 mmproj: 8 px
    patches, merge 2, any image size)."""
    from edgeinfer.formats.synthetic_vision import write_pixtral_text, write_tiny_pixtral
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "pixtral-text.gguf", directory / "pixtral-mmproj.gguf"
    if not text.exists():
        write_pixtral_text(text.with_suffix(".tmp")).rename(text)
    if not mmproj.exists():
        write_tiny_pixtral(mmproj.with_suffix(".tmp"), 256, seed=7).rename(mmproj)
    return text, mmproj
