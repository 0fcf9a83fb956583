"""LLaVA 1.5's projector ("mlp") against llama.cpp's libmtmd on synthetic files in its clip
layout: a CLIP tower (class embedding after the patches as llama.cpp lays it, pre-LayerNorm,
quick GELU, all layers but the last, rows 1..n_patches), mm.0 -> GELU -> mm.2, the
letterbox in LLaVA's grey with bicubic resampling; image tokens alone (no tags), causal."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.engine.images import MEDIA_MARKER
from edgeinfer.formats.image import decode_image, preprocess_fixed
from edgeinfer.formats.mmproj import read_mmproj

from vision_synth import llava_pair, noise_rgb, png_bytes

pytest.importorskip("llama_cpp.mtmd_cpp")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return llava_pair(tmp_path_factory.mktemp("llava"))


@pytest.mark.parametrize("hw", [(64, 64), (40, 90), (150, 70)])
def test_embeddings_match_libmtmd(pair, hw):
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    rgb = noise_rgb(*hw, seed=hw[0] + 1)
    o = MtmdOracle(str(pair[0]), str(pair[1]))
    try:
        want = o.embeddings(rgb)
    finally:
        o.close()
    gf, cfg = read_mmproj(str(pair[1]))
    assert (cfg.projector, cfg.ffn_op, cfg.layers_run, cfg.tokens_per_image) == \
        ("mlp", "gelu_quick", 2, 64)
    got = SiglipVision(cfg, make_ops("cpu"), gf).encode(preprocess_fixed(
        rgb, cfg.image_size, cfg.image_mean, cfg.image_std, cfg.pad_color, cfg.resample))
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch:cpu", "llamacpp"])
def test_layout_and_first_token_match_libmtmd(pair, backend):
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    from edgeinfer.engine.images import splice_images
    from mtmd_oracle import as_layout, assert_first_token_matches, layout_and_logits
    e = Engine(str(pair[0]), EngineConfig(backend=backend, kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        text = f"the {MEDIA_MARKER} a"
        img = decode_image(png_bytes(noise_rgb(50, 64, seed=6)))
        first = e.tokenizer.encode(text.partition(MEDIA_MARKER)[0], add_special=True,
                                   parse_special=True)
        ids, spans = splice_images(e.tokenizer, text, [e.vision.encode(img)], first,
                                   e.vision.layout)
        assert len(spans) == 1 and not spans[0].bidirectional
        flat, want = layout_and_logits(str(pair[0]), str(pair[1]), text, [img.rgb])
        assert as_layout(ids) == flat
        out = e.generate(ids, greedy(2, logprobs=0), images=spans)
        assert_first_token_matches(out, want)
    finally:
        e.close()
