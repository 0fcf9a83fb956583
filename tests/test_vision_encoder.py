"""The Gemma 3 vision encoder (SigLIP + projector) against llama.cpp's libmtmd on a synthetic
mmproj in llama.cpp's exact clip layout; image decoding and projector checks."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from edgeinfer.formats.gguf_file import GGUFError
from edgeinfer.formats.image import (ImageError, b64_image, decode_image, preprocess_fixed,
                                     resize_fit_pad)
from edgeinfer.formats.mmproj import check_pair, read_mmproj

from vision_synth import noise_rgb, png_bytes, vision_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def oracle(pair):
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from mtmd_oracle import MtmdOracle
    o = MtmdOracle(str(pair[0]), str(pair[1]))
    yield o
    o.close()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("hw", [(64, 64), (50, 90), (200, 120)])
def test_embeddings_match_libmtmd(pair, oracle, backend, hw):
    """Resize (Pillow bilinear, black bars), SigLIP, pool, norm, projection: libmtmd's
    numbers within float tolerance, on both native backends."""
    if backend == "torch":
        pytest.importorskip("torch")
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    gf, cfg = read_mmproj(str(pair[1]))
    rgb = noise_rgb(*hw, seed=hw[0])
    want = oracle.embeddings(rgb)
    enc = SiglipVision(cfg, make_ops(backend), gf)
    got = enc.encode(preprocess_fixed(rgb, cfg.image_size, cfg.image_mean, cfg.image_std))
    assert got.shape == want.shape == (cfg.tokens_per_image, 256)
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)


def test_resize_pads_to_square():
    rgb = np.full((20, 40, 3), 200, np.uint8)
    out = resize_fit_pad(rgb, 64)
    assert out.shape == (64, 64, 3)
    assert (out[:16] == 0).all() and (out[48:] == 0).all() and (out[16:48] == 200).all()


def test_decode_and_bad_images():
    rgb = noise_rgb(10, 12)
    img = decode_image(png_bytes(rgb))
    assert img.size == (12, 10) and (img.rgb == rgb).all() and len(img.digest) == 64
    jpg = decode_image(png_bytes(rgb, "JPEG"))
    assert jpg.rgb.shape == (10, 12, 3)
    data = png_bytes(noise_rgb(64, 64))
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(data[:len(data) // 2])
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"hello, this is text")
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")
    with pytest.raises(ImageError, match="MB limit"):
        decode_image(data, max_bytes=100)
    with pytest.raises(ImageError, match="megapixel"):
        decode_image(data, max_pixels=1000)
    from PIL import Image
    import io
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "TIFF")
    with pytest.raises(ImageError, match="TIFF"):
        decode_image(buf.getvalue())


def test_base64_forms():
    data = png_bytes(noise_rgb(4, 4))
    b = base64.b64encode(data).decode()
    assert b64_image(b) == data
    assert b64_image("data:image/png;base64," + b) == data
    with pytest.raises(ImageError, match="base64"):
        b64_image("data:image/png," + b)
    with pytest.raises(ImageError, match="not valid base64"):
        b64_image("!!!not base64!!!")


def test_projector_checks(pair):
    with pytest.raises(GGUFError, match="not a vision projector"):
        read_mmproj(str(pair[0]))
    gf, cfg = read_mmproj(str(pair[1]))
    gf.close()
    assert (cfg.projector, cfg.tokens_per_image, cfg.n_embd_text) == ("gemma3", 16, 256)
    check_pair(cfg, 256)
    with pytest.raises(GGUFError, match="belongs to another model"):
        check_pair(cfg, 640)


@pytest.mark.parametrize("swapped", [False, True])
def test_f16_projector_matches_libmtmd(pair, tmp_path, swapped):
    """Released mmproj files keep their matrices in f16: the tower computes them with the
    f16 kernels (activations rounded to f16 as ggml does) and still matches; early Gemma 3
    conversions had ffn_up / ffn_down swapped, which both sides read back the right way."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from edgeinfer.formats.synthetic_vision import write_tiny_mmproj
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    f16 = write_tiny_mmproj(tmp_path / "f16.gguf", 256, f16=True, seed=5, swapped_ffn=swapped)
    rgb = noise_rgb(70, 64, seed=9)
    o = MtmdOracle(str(pair[0]), str(f16))
    try:
        want = o.embeddings(rgb)
    finally:
        o.close()
    gf, cfg = read_mmproj(str(f16))
    got = SiglipVision(cfg, make_ops("cpu"), gf).encode(
        preprocess_fixed(rgb, cfg.image_size, cfg.image_mean, cfg.image_std))
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)


def test_real_gemma3_geometry_matches_libmtmd(pair, tmp_path):
    """Gemma 3's real geometry on a narrow tower: 896 px, 14 px patches (64 x 64 = 4096),
    no scale_factor key (the default 4x4 pool), 256 tokens; a 1200x700 photo-sized image
    letterboxed to it. libmtmd's numbers."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from edgeinfer.formats.synthetic_vision import TinyVisionShape, write_tiny_mmproj
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    shape = TinyVisionShape(n_embd=64, n_ff=128, n_head=4, layers=2, image_size=896,
                            patch_size=14, n_merge=4)
    path = write_tiny_mmproj(tmp_path / "g896.gguf", 256, shape, seed=21, f16=True,
                             scale_key=False)
    rgb = noise_rgb(700, 1200, seed=22)
    o = MtmdOracle(str(pair[0]), str(path))
    try:
        want = o.embeddings(rgb)
    finally:
        o.close()
    gf, cfg = read_mmproj(str(path))
    assert (cfg.n_merge, cfg.tokens_per_image) == (4, 256)
    got = SiglipVision(cfg, make_ops("cpu"), gf).encode(
        preprocess_fixed(rgb, cfg.image_size, cfg.image_mean, cfg.image_std))
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_projector_matches_libmtmd(pair, tmp_path, qtype):
    """A quantized mmproj's block matrices stay quantized and run on the text model's
    kernels (8-bit activations as ggml's): still libmtmd's numbers within tolerance."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from edgeinfer.formats.synthetic_vision import write_tiny_mmproj
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from mtmd_oracle import MtmdOracle
    path = write_tiny_mmproj(tmp_path / f"{qtype}.gguf", 256, seed=13, block_qtype=qtype)
    rgb = noise_rgb(64, 64, seed=14)
    o = MtmdOracle(str(pair[0]), str(path))
    try:
        want = o.embeddings(rgb)
    finally:
        o.close()
    gf, cfg = read_mmproj(str(path))
    enc = SiglipVision(cfg, make_ops("cpu"), gf)
    assert type(enc.blocks[0].wq).__name__ in ("QuantMatrix", "PackedMatrix")
    got = enc.encode(preprocess_fixed(rgb, cfg.image_size, cfg.image_mean, cfg.image_std))
    # 2.8e-3 of max measured here (8-bit activations on both sides, different sum orders)
    np.testing.assert_allclose(got, want, atol=5e-3 * np.abs(want).max(), rtol=0)
