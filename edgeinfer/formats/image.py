"""Images in: decode (Pillow), check, and preprocess as llama.cpp's libmtmd does.

`decode_image` turns the bytes a client sent into RGB pixels, refusing what is not an image,
a format we do not take, and anything over the limits (bytes, megapixels) before decoding
the pixels. `preprocess_fixed` is libmtmd's fixed-size preprocessing (Gemma 3): scale to fit
the square keeping the aspect ratio (Pillow-compatible bilinear resampling, which llama.cpp
reimplements), pad with black to the square, centered, then (x / 255 - mean) / std per
channel.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """An image that cannot be used; the message is one sentence for the client."""


@dataclass(frozen=True)
class Image:
    """One decoded image: RGB pixels [height, width, 3] and the sha256 of its bytes."""
    rgb: np.ndarray
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        return int(self.rgb.shape[1]), int(self.rgb.shape[0])


def b64_image(data: str, what: str = "image") -> bytes:
    """Base64 (plain, or a data: URL) to bytes; ImageError when it is not base64."""
    s = data.strip()
    if s.startswith("data:"):
        head, sep, s = s.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError(f"{what}: a data URL must be base64-encoded "
                             "(data:image/png;base64,...)")
    if len(s) > (MAX_IMAGE_BYTES * 4) // 3 + 8:
        raise ImageError(f"{what} is larger than the {MAX_IMAGE_BYTES // (1024 * 1024)} MB "
                         "limit")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is not valid base64") from None


def decode_image(data: bytes, what: str = "image", max_bytes: int = MAX_IMAGE_BYTES,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """Bytes of a PNG / JPEG / WebP / GIF (first frame) / BMP to RGB pixels."""
    from PIL import Image as PILImage  # lazy: Pillow is optional (the vision extra)
    from PIL import UnidentifiedImageError
    if not data:
        raise ImageError(f"{what} is empty")
    if len(data) > max_bytes:
        raise ImageError(f"{what} is {len(data) / 2**20:.1f} MB, more than the "
                         f"{max_bytes // 2**20} MB limit")
    try:
        im = PILImage.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in a known format "
                         f"({', '.join(FORMATS)})") from None
    except Exception as e:
        raise ImageError(f"{what} could not be read: {e}") from None
    if im.format not in FORMATS:
        raise ImageError(f"{what} is {im.format}, which is not supported "
                         f"({', '.join(FORMATS)})")
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageError(f"{what} has no pixels")
    if w * h > max_pixels:
        raise ImageError(f"{what} is {w}x{h} = {w * h / 1e6:.0f} megapixels, more than "
                         f"the {max_pixels / 1e6:.0f} megapixel limit")
    try:
        im.seek(0)
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:     # truncated or corrupt data shows up when the pixels load
        raise ImageError(f"{what} is corrupt or truncated ({type(e).__name__}: {e})") from None
    return Image(np.ascontiguousarray(rgb), hashlib.sha256(data).hexdigest())


def resize_fit_pad(rgb: np.ndarray, size: int, pad_color=(0, 0, 0),
                   resample: str = "bilinear") -> np.ndarray:
    """libmtmd's resize to size x size with PAD_CEIL: scale to fit (Pillow's bilinear or
    bicubic), bars of `pad_color` (black for Gemma 3, LLaVA's mean grey for LLaVA)."""
    from PIL import Image as PILImage  # lazy: Pillow is optional (the vision extra)
    h, w = int(rgb.shape[0]), int(rgb.shape[1])
    if (w, h) == (size, size):
        return rgb
    sw = np.float32(size) / np.float32(w)
    sh = np.float32(size) / np.float32(h)
    s = min(sw, sh)
    nw = min(int(math.ceil(np.float32(w) * s)), size)
    nh = min(int(math.ceil(np.float32(h) * s)), size)
    filt = PILImage.BICUBIC if resample == "bicubic" else PILImage.BILINEAR
    small = _resize(rgb, nw, nh, filt)
    out = np.empty((size, size, 3), np.uint8)
    out[:] = np.asarray(pad_color, np.uint8)
    ox, oy = (size - nw) // 2, (size - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = small
    return out


def preprocess_fixed(rgb: np.ndarray, size: int, mean, std, pad_color=(0, 0, 0),
                     resample: str = "bilinear") -> np.ndarray:
    """float32 [3, size, size]: resized, padded, normalized pixels."""
    px = resize_fit_pad(rgb, size, pad_color, resample).astype(np.float32) / np.float32(255.0)
    px = (px - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(px.transpose(2, 0, 1))


def _resize(rgb: np.ndarray, w: int, h: int, resample) -> np.ndarray:
    """Pillow's resampling as libmtmd reimplements it: the horizontal pass, then the
    vertical one, through 8-bit pixels. (One Pillow resize may run the vertical pass first
    when that reduces more, which rounds differently: up to 0.05 apart after a tower.)"""
    from PIL import Image as PILImage  # lazy: Pillow is optional (the vision extra)
    H, W = int(rgb.shape[0]), int(rgb.shape[1])
    if W != w:
        rgb = np.asarray(PILImage.fromarray(rgb, "RGB").resize((w, H), resample), np.uint8)
    if H != h:
        rgb = np.asarray(PILImage.fromarray(rgb, "RGB").resize((w, h), resample), np.uint8)
    return rgb


def idefics3_grid(width: int, height: int, tile: int, longest_edge: int
                  ) -> tuple[tuple[int, int], int, int]:
    """libmtmd's Idefics3 (SmolVLM) sizes: the longest edge scaled to `longest_edge` (the
    other kept in ratio, made even), then up to whole tiles: ((w, h) after the first resize,
    tiles across, tiles down)."""
    aspect = width / height
    if width >= height:
        rw, rh = longest_edge, int(longest_edge / aspect)
        rh += rh % 2
    else:
        rw, rh = int(longest_edge * aspect), longest_edge
        rw += rw % 2
    return (rw, rh), -(-rw // tile), -(-rh // tile)


def preprocess_idefics3(rgb: np.ndarray, tile: int, longest_edge: int, mean, std
                        ) -> tuple[list[np.ndarray], int, int]:
    """libmtmd's Idefics3 preprocessing: Lanczos to the longest edge, then to whole tiles,
    cut into tile x tile crops (rows first), plus the whole as one tile (the overview).
    Returns float32 [3, tile, tile] arrays, crops then overview, and the grid (x, y)."""
    from PIL import Image as PILImage  # lazy: Pillow is optional (the vision extra)
    lanczos = PILImage.LANCZOS
    (rw, rh), gx, gy = idefics3_grid(int(rgb.shape[1]), int(rgb.shape[0]), tile, longest_edge)
    refined = _resize(_resize(rgb, rw, rh, lanczos), gx * tile, gy * tile, lanczos)
    overview = _resize(refined, tile, tile, lanczos)
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def norm(px: np.ndarray) -> np.ndarray:
        f = px.astype(np.float32) / np.float32(255.0)
        return np.ascontiguousarray(((f - m) / s).transpose(2, 0, 1))
    crops = [norm(refined[y * tile:(y + 1) * tile, x * tile:(x + 1) * tile])
             for y in range(gy) for x in range(gx)]
    return crops + [norm(overview)], gx, gy


def _f32(x) -> np.float32:
    return np.float32(x)


def dynamic_size(width: int, height: int, align: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """libmtmd's calc_size_preserved_ratio (Pixtral): sides rounded to multiples of `align`,
    then scaled into [min_pixels, max_pixels] keeping the ratio (float32 arithmetic)."""
    f = _f32(align)

    def rnd(x):     # std::round of a float32 quotient: half away from zero
        return int(math.floor(float(_f32(x) / f) + 0.5)) * align

    w_bar = max(align, rnd(width))
    h_bar = max(align, rnd(height))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(_f32(_f32(height) * width / max_pixels))
        h_bar = max(align, int(math.floor(float(_f32(_f32(height) / beta) / f))) * align)
        w_bar = max(align, int(math.floor(float(_f32(_f32(width) / beta) / f))) * align)
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(_f32(_f32(min_pixels) / (_f32(height) * width)))
        h_bar = int(math.ceil(float(_f32(_f32(height) * beta) / f))) * align
        w_bar = int(math.ceil(float(_f32(_f32(width) * beta) / f))) * align
    return w_bar, h_bar


def preprocess_dynamic(rgb: np.ndarray, align: int, min_pixels: int, max_pixels: int,
                       mean, std) -> np.ndarray:
    """libmtmd's dynamic-size preprocessing (Pixtral): the size from dynamic_size, the image
    scaled to fit it (bicubic, horizontal pass first) and centered on black, normalized.
    float32 [3, H, W]."""
    from PIL import Image as PILImage  # lazy: Pillow is optional (the vision extra)
    h, w = int(rgb.shape[0]), int(rgb.shape[1])
    tw, th = dynamic_size(w, h, align, min_pixels, max_pixels)
    if (tw, th) == (w, h):
        out = rgb
    else:
        s = min(_f32(tw) / _f32(w), _f32(th) / _f32(h))
        nw = min(int(np.ceil(_f32(w) * s)), tw)
        nh = min(int(np.ceil(_f32(h) * s)), th)
        small = _resize(rgb, nw, nh, PILImage.BICUBIC)
        out = np.zeros((th, tw, 3), np.uint8)
        ox, oy = (tw - nw) // 2, (th - nh) // 2
        out[oy:oy + nh, ox:ox + nw] = small
    px = out.astype(np.float32) / np.float32(255.0)
    px = (px - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(px.transpose(2, 0, 1))
