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
    from mtmd_oracle import MtmdOracle
    e = Engine(str(pair[0]), EngineConfig(backend=backend, kv_budget_bytes=16 << 20),
               mmproj=str(pair[1]))
    try:
        text = f"hello {MEDIA_MARKER} world"
        img = decode_image(png_bytes(noise_rgb(100, 60, seed=4)))
        ids, spans = _prompt(e, text, [img])
        assert len(spans) == 5 and not spans[0].bidirectional     # 2x2 tiles + overview
        o = MtmdOracle(str(pair[0]), str(pair[1]))
        try:
            layout = o.tokens(text, [img.rgb])
            want = o.next_logits(text, [img.rgb])
        finally:
            o.close()
        flat = []
        for part in layout:
            flat += ["img"] * part if isinstance(part, int) else part
        assert [("img" if t < 0 else t) for t in ids] == flat
        out = e.generate(ids, greedy(2, logprobs=0), images=spans)
        lp = want - want.max()
        lp = lp - np.log(np.exp(lp).sum())
        assert out.token_ids[0] == int(want.argmax())
        assert abs(out.logprobs[0] - lp[out.token_ids[0]]) < 2e-3
    finally:
        e.close()
