"""SmolVLM's projector (Idefics3) against llama.cpp's libmtmd on synthetic files in its clip
layout: Lanczos resize to the longest edge, tiles + overview, pixel shuffle + fc; the token
layout (<fake_token_around_image><row_R_col_C> per tile, "\\n" between rows, the overview
after "\\n\\n<fake_token_around_image><global-img>"), causal image tokens, and the
next-token logits on every backend."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.engine.images import MEDIA_MARKER
from edgeinfer.formats.image import decode_image, preprocess_idefics3
from edgeinfer.formats.mmproj import read_mmproj

from vision_synth import noise_rgb, png_bytes, smolvlm_pair

pytest.importorskip("llama_cpp.mtmd_cpp")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return smolvlm_pair(tmp_path_factory.mktemp("smolvlm"))


def _prompt(engine, text, images):
    from edgeinfer.engine.images import splice_images
    first = engine.tokenizer.encode(text.partition(MEDIA_MARKER)[0], add_special=True,
                                    parse_special=True)
    return splice_images(engine.tokenizer, text, [engine.vision.encode(i) for i in images],
                         first, engine.vision.layout)


@pytest.mark.parametrize("hw", [(100, 60), (40, 130), (64, 64)])
def test_tiles_match_libmtmd(pair, hw):
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    rgb = noise_rgb(*hw, seed=hw[1])
    o = MtmdOracle(str(pair[0]), str(pair[1]))
    try:
        want = o.embeddings(rgb)            # libmtmd's first image chunk: the first tile
    finally:
        o.close()
    gf, cfg = read_mmproj(str(pair[1]))
    crops, gx, gy = preprocess_idefics3(rgb, cfg.image_size, cfg.longest_edge, cfg.image_mean,
                                        cfg.image_std)
    got = SiglipVision(cfg, make_ops("cpu"), gf).encode(crops[0])
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch:cpu", "llamacpp"])
def test_layout_and_logits_match_libmtmd(pair, backend):
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    from mtmd_oracle import as_layout, assert_first_token_matches, layout_and_logits
    e = Engine(str(pair[0]), EngineConfig(backend=backend, kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        text = f"hello {MEDIA_MARKER} world"
        img = decode_image(png_bytes(noise_rgb(100, 60, seed=4)))
        ids, spans = _prompt(e, text, [img])
        assert len(spans) == 5 and not spans[0].bidirectional     # 2x2 tiles + overview
        flat, want = layout_and_logits(str(pair[0]), str(pair[1]), text, [img.rgb])
        assert as_layout(ids) == flat
        out = e.generate(ids, greedy(2, logprobs=0), images=spans)
        assert_first_token_matches(out, want)
    finally:
        e.close()


def test_real_smolvlm_geometry(pair, tmp_path):
    """SmolVLM's real geometry on a narrow tower: 512 px tiles of 16 px patches (1024),
    pixel shuffle 4 -> 64 tokens a tile, longest edge 2048: a 300x200 image becomes 4x3
    tiles + the overview. The first tile's embeddings and the whole token layout are
    libmtmd's."""
    from edgeinfer.formats.synthetic_vision import TinyVisionShape, write_tiny_mmproj
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    shape = TinyVisionShape(n_embd=32, n_ff=64, n_head=2, layers=1, image_size=512,
                            patch_size=16, n_merge=4)
    path = write_tiny_mmproj(tmp_path / "smol512.gguf", 256, shape, seed=31, f16=True,
                             projector="idefics3", longest_edge=2048)
    rgb = noise_rgb(200, 300, seed=32)
    text = f"a {MEDIA_MARKER} b"
    o = MtmdOracle(str(pair[0]), str(path), n_ctx=2048, n_batch=1024)
    try:
        want = o.embeddings(rgb)
        layout = o.tokens(text, [rgb])
    finally:
        o.close()
    gf, cfg = read_mmproj(str(path))
    crops, gx, gy = preprocess_idefics3(rgb, cfg.image_size, cfg.longest_edge, cfg.image_mean,
                                        cfg.image_std)
    assert (gx, gy, cfg.tokens_per_image) == (4, 3, 64)
    got = SiglipVision(cfg, make_ops("cpu"), gf).encode(crops[0])
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
    # the layout, without running the tower on all 13 tiles: a stand-in encoder
    from edgeinfer.engine.images import EncodedImage, Layout, splice_images
    from edgeinfer.formats.tokenizer import Tokenizer
    from edgeinfer.formats.gguf_file import read_gguf
    tf = read_gguf(str(pair[0]))
    try:
        tok = Tokenizer.from_gguf(tf.metadata)
    finally:
        tf.close()
    fake = EncodedImage("ab" * 32, tuple(np.zeros((64, 256), np.float32) for _ in range(13)),
                        (4, 3))
    ids, spans = splice_images(tok, text, [fake],
                               tok.encode("a ", add_special=True, parse_special=True),
                               Layout(tok, cfg))
    flat = []
    for part in layout:
        flat += ["img"] * part if isinstance(part, int) else part
    assert [("img" if t < 0 else t) for t in ids] == flat and len(spans) == 13
