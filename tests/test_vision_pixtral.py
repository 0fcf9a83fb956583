"""Pixtral / Mistral Small 3.1's projector against llama.cpp's libmtmd on synthetic files in
its clip layout: the dynamic size (sides multiples of patch x merge, 8..1024 tokens), 2-D
RoPE, RMSNorm + SwiGLU blocks, the patch merger, mm.1 -> GELU -> mm.2, [IMG_BREAK] rows and
[IMG_END]; image tokens causal; first token on every backend."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.engine.images import MEDIA_MARKER
from edgeinfer.formats.image import decode_image, dynamic_size, preprocess_dynamic
from edgeinfer.formats.mmproj import read_mmproj

from vision_synth import noise_rgb, pixtral_pair, png_bytes

pytest.importorskip("llama_cpp.mtmd_cpp")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pixtral_pair(tmp_path_factory.mktemp("pixtral"))


def test_dynamic_sizes():
    a = 16
    assert dynamic_size(64, 64, a, 8 * a * a, 1024 * a * a) == (64, 64)
    assert dynamic_size(80, 48, a, 8 * a * a, 1024 * a * a) == (80, 48)
    assert dynamic_size(30, 100, a, 8 * a * a, 1024 * a * a) == (32, 96)
    w, h = dynamic_size(4000, 3000, a, 8 * a * a, 1024 * a * a)
    assert w * h <= 1024 * a * a and w % a == 0 and h % a == 0


@pytest.mark.parametrize("hw", [(64, 64), (48, 80), (100, 30), (7, 300)])
def test_embeddings_match_libmtmd(pair, hw):
    from edgeinfer.models.pixtral_vision import PixtralVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import embeddings_in_fresh_process
    rgb = noise_rgb(*hw, seed=hw[0])
    want = embeddings_in_fresh_process(str(pair[0]), str(pair[1]), rgb)
    gf, cfg = read_mmproj(str(pair[1]))
    a = cfg.patch_size * cfg.n_merge
    got = PixtralVision(cfg, make_ops("cpu"), gf).encode(preprocess_dynamic(
        rgb, a, cfg.min_tokens * a * a, cfg.max_tokens * a * a, cfg.image_mean,
        cfg.image_std))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)


LAYOUT_TEXT = f"the {MEDIA_MARKER} a"


@pytest.fixture(scope="module")
def libmtmd_layout(pair):
    """libmtmd's layout and next-token logits for the prompt below, once, in a process of
    its own (mtmd_oracle.in_fresh_process says why)."""
    from mtmd_oracle import in_fresh_process, layout_and_logits
    img = decode_image(png_bytes(noise_rgb(48, 80, seed=8)))
    flat, want = in_fresh_process(layout_and_logits, str(pair[0]), str(pair[1]), LAYOUT_TEXT,
                                  [img.rgb])
    assert np.isfinite(want).all()
    return flat, want


@pytest.mark.parametrize("backend", ["cpu", "torch:cpu", "llamacpp"])
def test_layout_and_first_token_match_libmtmd(pair, libmtmd_layout, backend):
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    from edgeinfer.engine.images import splice_images
    from mtmd_oracle import as_layout, assert_first_token_matches
    e = Engine(str(pair[0]), EngineConfig(backend=backend, kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        text = LAYOUT_TEXT
        img = decode_image(png_bytes(noise_rgb(48, 80, seed=8)))
        first = e.tokenizer.encode(text.partition(MEDIA_MARKER)[0], add_special=True,
                                   parse_special=True)
        ids, spans = splice_images(e.tokenizer, text, [e.vision.encode(img)], first,
                                   e.vision.layout)
        assert len(spans) == 1 and not spans[0].bidirectional
        flat, want = libmtmd_layout
        assert as_layout(ids) == flat
        out = e.generate(ids, greedy(2, logprobs=0), images=spans)
        assert_first_token_matches(out, want)
    finally:
        e.close()
