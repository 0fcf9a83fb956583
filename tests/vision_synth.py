"""Synthetic vision test data: a tiny Gemma 3 text model with the image tags, its mmproj in
llama.cpp's clip layout (edgeinfer/formats/synthetic_vision.py), and small test images."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from build_once import build_once
from edgeinfer.formats.synthetic_vision import write_gemma3_vision_text, write_tiny_mmproj


def vision_pair(directory: Path) -> tuple[Path, Path]:
    """(text model, mmproj) written once into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "gemma3-vision-text.gguf", directory / "gemma3-mmproj.gguf"
    build_once(text, write_gemma3_vision_text)
    build_once(mmproj, lambda tmp: write_tiny_mmproj(tmp, 256))
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
    build_once(text, write_smolvlm_text)
    build_once(mmproj, lambda tmp: write_tiny_mmproj(tmp, 256, projector="idefics3",
                          longest_edge=128, seed=3))
    return text, mmproj


def llava_pair(directory: Path) -> tuple[Path, Path]:
    """(tests/synth.py's llama text model, a LLaVA 1.5 "mlp" mmproj: CLIP tower of 3 layers
    (2 run), 64 px, 8 px patches -> 64 image tokens)."""
    import synth
    from edgeinfer.formats.synthetic_vision import TinyVisionShape
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "llava-text.gguf", directory / "llava-mmproj.gguf"
    build_once(text, lambda tmp: synth.write_model(tmp, "llama"))
    build_once(mmproj, lambda tmp: write_tiny_mmproj(tmp, 256, TinyVisionShape(layers=3),
                          projector="mlp", seed=5))
    return text, mmproj


def pixtral_pair(directory: Path) -> tuple[Path, Path]:
    """(llama text model with [IMG_END], a Pixtral / Mistral Small 3.1 mmproj: 8 px
    patches, merge 2, any image size)."""
    from edgeinfer.formats.synthetic_vision import write_pixtral_text, write_tiny_pixtral
    directory.mkdir(parents=True, exist_ok=True)
    text, mmproj = directory / "pixtral-text.gguf", directory / "pixtral-mmproj.gguf"
    build_once(text, write_pixtral_text)
    build_once(mmproj, lambda tmp: write_tiny_pixtral(tmp, 256, seed=7))
    return text, mmproj
