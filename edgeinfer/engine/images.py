"""Images as spans of a sequence.

A prompt with images is one token list in which each image is a run of placeholder ids, one
per image token, wrapped in the model's image tags as llama.cpp's libmtmd lays them out
(Gemma 3: <start_of_image> ... <end_of_image>; SmolVLM / Idefics3: one run per tile, each
after <fake_token_around_image><row_R_col_C>, rows ended by "\n", then the overview after
"\n\n<fake_token_around_image><global-img>" and before <fake_token_around_image>). A placeholder id is negative (never a
vocabulary id) and derived from the image's content hash and the token's place in it (30
bits each, so a block of 16 image tokens carries ~480 bits of the hash: two images never
share a block by accident), so the prefix cache, which keys blocks by token ids, keys image
blocks by the image: the same image at the same place of the
same prefix reuses its KV, another image never does. The embeddings travel beside the ids
(`ImageSpan`, to the runner in NewRequest.images), and the runner puts them in place of the
token embeddings of those positions.

Inside one image, attention is bidirectional for Gemma 3 (llama.cpp decodes its image batch
non-causally): every position of an image sees every position of that image, so the
scheduler never cuts an image across two steps (Sequence.image_spans). Idefics3 images are
causal, like text.

`VisionEncoder` is a loaded projector (mmproj) on a backend: preprocess + encode, with a
small LRU of encoder outputs by content hash (the same image sent again is not re-encoded).
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgeinfer.formats.image import (idefics3_grid, preprocess_dynamic, preprocess_fixed,
                                     preprocess_idefics3)
from edgeinfer.formats.mmproj import check_pair, read_mmproj
from edgeinfer.runners.base import ImageSpan

__all__ = ["EncodedImage", "ImageSpan", "MEDIA_MARKER", "VisionEncoder", "VisionError",
           "image_tags", "placeholder_ids", "splice_images"]

# where an image goes in rendered chat text (llama.cpp's default media marker)
MEDIA_MARKER = "<__media__>"
_PLACEHOLDER_MASK = (1 << 30) - 1


def placeholder_ids(digest: str, n: int) -> list[int]:
    """The (negative) token ids of the n positions of the image part with this sha256:
    one 30-bit hash of (digest, position) each."""
    key = bytes.fromhex(digest)
    out = []
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=4, key=key[:64])
        out.append(-(1 + (int.from_bytes(h.digest(), "little") & _PLACEHOLDER_MASK)))
    return out


class VisionError(ValueError):
    """A request or a load the vision path cannot take; one sentence."""


@dataclass(frozen=True)
class EncodedImage:
    """An image's embeddings: one float32 [tokens, width] array per encoded square (Gemma 3:
    the image; Idefics3: its tiles row by row, then the overview) and the tile grid."""
    digest: str
    parts: tuple[np.ndarray, ...]
    grid: tuple[int, int] | None = None        # (across, down) for tiled projectors

    def part_digest(self, k: int) -> str:
        """A content key per part (the image's own for a one-part image)."""
        if len(self.parts) == 1:
            return self.digest
        return hashlib.sha256(f"{self.digest}/{k}".encode()).hexdigest()


class VisionEncoder:
    """One projector file loaded on a native backend's ops."""

    def __init__(self, path: str, backend: str = "cpu", cache_images: int = 16,
                 runner=None):
        """`runner`: the text model's; where its own library encodes images (the llama.cpp
        runner: libmtmd, `runner.image_encoder(path)` not None), that encoder, else the
        native tower on `backend`'s ops."""
        self.path = path
        self.gf, self.cfg = read_mmproj(path)
        self._external = None
        try:
            if runner is not None:
                self._external = runner.image_encoder(path)
            if self._external is not None:
                self.model = None
            else:
                # lazy: the native tower and its backend load in the engine process, never
                # with the daemon's `import edgeinfer.engine`
                from edgeinfer.models.siglip import SiglipVision
                from edgeinfer.runners.native import make_ops
                # the tower's own ops (its repack choice and per-step caches stay apart from
                # the text model's); torch on the device the text model uses
                ops = make_ops(backend if backend.startswith("torch") else "cpu")
                if self.cfg.projector == "pixtral":
                    from edgeinfer.models.pixtral_vision import PixtralVision  # lazy: as above
                    self.model = PixtralVision(self.cfg, ops, self.gf)
                else:
                    self.model = SiglipVision(self.cfg, ops, self.gf)
        except BaseException:
            self.gf.close()
            raise
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, EncodedImage] = OrderedDict()
        self._cache_images = cache_images
        self.encoded = 0            # images run through the tower (cache misses)
        self.cache_hits = 0
        self.encode_seconds = 0.0   # time in preprocessing + the tower + the projector

    @property
    def tokens_per_image(self) -> int:
        return self.cfg.tokens_per_image

    def stats(self) -> dict:
        """For /api/stats and /metrics (any thread: plain reads)."""
        return {"projector": self.cfg.projector, "images_encoded": self.encoded,
                "image_cache_hits": self.cache_hits,
                "encode_seconds": round(self.encode_seconds, 4)}

    @property
    def nbytes(self) -> int:
        return int(self.gf.file_size)

    def encode(self, image) -> EncodedImage:
        """The embeddings of an edgeinfer.formats.image.Image (cached by its sha256)."""
        with self._lock:
            hit = self._cache.get(image.digest)
            if hit is not None:
                self._cache.move_to_end(image.digest)
                self.cache_hits += 1
                return hit
            t0 = time.perf_counter()
            cfg = self.cfg
            grid = None
            if cfg.projector == "idefics3":
                w, h = image.size
                _, gx, gy = idefics3_grid(w, h, cfg.image_size, cfg.longest_edge)
                grid = (gx, gy)
            if self._external is not None:
                parts = list(self._external(image.rgb))
            elif cfg.projector == "pixtral":
                a = cfg.patch_size * cfg.n_merge
                parts = [self.model.encode(preprocess_dynamic(
                    image.rgb, a, cfg.min_tokens * a * a, cfg.max_tokens * a * a,
                    cfg.image_mean, cfg.image_std))]
            elif cfg.projector == "idefics3":
                crops, _, _ = preprocess_idefics3(image.rgb, cfg.image_size, cfg.longest_edge,
                                                  cfg.image_mean, cfg.image_std)
                parts = [self.model.encode(c) for c in crops]
            else:
                parts = [self.model.encode(preprocess_fixed(
                    image.rgb, cfg.image_size, cfg.image_mean, cfg.image_std, cfg.pad_color,
                    cfg.resample))]
            expect = 1 + grid[0] * grid[1] if grid else 1
            if len(parts) != expect:
                raise VisionError(f"the encoder made {len(parts)} image parts, "
                                  f"expected {expect}")
            for p in parts:
                p.setflags(write=False)
            out = EncodedImage(image.digest, tuple(parts), grid)
            self.encode_seconds += time.perf_counter() - t0
            self._cache[image.digest] = out
            while len(self._cache) > self._cache_images:
                self._cache.popitem(last=False)
            self.encoded += 1
            return out

    def close(self) -> None:
        self.model = None
        if self._external is not None:
            self._external.close()
            self._external = None
        self._cache.clear()
        self.gf.close()


def image_tags(tokenizer) -> tuple[int, int]:
    """Gemma 3's <start_of_image> / <end_of_image> ids; VisionError when the vocabulary
    lacks them (a text-only vocabulary)."""
    t2i = tokenizer.token_to_id
    try:
        return t2i["<start_of_image>"], t2i["<end_of_image>"]
    except KeyError:
        raise VisionError("the model's vocabulary has no <start_of_image> / <end_of_image> "
                          "tokens: it is not a vision model") from None


def _piece_id(tokenizer, text: str) -> int:
    """The token whose text is `text` (libmtmd's lookup_token), or VisionError."""
    want = text.encode()
    for i in range(len(tokenizer.token_to_id)):
        try:
            if tokenizer.piece(i, True) == want:
                return i
        except Exception:       # noqa: BLE001 - a token without a piece
            continue
    raise VisionError(f"the model's vocabulary has no token {text!r}: it is not this "
                      "projector's model")


class Layout:
    """How a projector's images sit among the tokens (libmtmd's layout for it)."""

    def __init__(self, tokenizer, cfg):
        self.tokenizer, self.projector = tokenizer, cfg.projector
        self.bidirectional = cfg.projector == "gemma3"
        if cfg.projector == "gemma3":
            self.begin, self.end = image_tags(tokenizer)
            return
        if cfg.projector == "mlp":      # LLaVA: the image's tokens alone, no tags
            return
        if cfg.projector == "pixtral":  # the image's tokens (with [IMG_BREAK] rows), [IMG_END]
            if "[IMG_END]" not in tokenizer.token_to_id:
                raise VisionError("the model's vocabulary has no [IMG_END] token: it is not a "
                                  "Pixtral / Mistral Small 3.1 model")
            self.end_ids = tokenizer.encode("[IMG_END]", add_special=False, parse_special=True)
            return
        t2i = tokenizer.token_to_id
        names = ("<fake_token_around_image>", "<global-img>")
        if any(n not in t2i for n in names):
            raise VisionError("the model's vocabulary has no <fake_token_around_image> / "
                              "<global-img> tokens: it is not an Idefics3 (SmolVLM) model")
        self.fake, self.global_img = t2i[names[0]], t2i[names[1]]
        self.nl, self.nlnl = _piece_id(tokenizer, "\n"), _piece_id(tokenizer, "\n\n")
        most = -(-cfg.longest_edge // cfg.image_size)
        if f"<row_{most}_col_{most}>" not in t2i:
            raise VisionError(f"the model's vocabulary has no <row_{most}_col_{most}> token "
                              f"that this projector's {most}x{most} tiles need")

    def items(self, enc: EncodedImage) -> list:
        """Token ids and ("img", part index) entries, in order."""
        if self.projector == "gemma3":
            return [self.begin, ("img", 0), self.end]
        if self.projector == "mlp":
            return [("img", 0)]
        if self.projector == "pixtral":
            return [("img", 0), *self.end_ids]
        gx, gy = enc.grid
        out: list = []
        for y in range(gy):
            for x in range(gx):
                out += self.tokenizer.encode(f"<fake_token_around_image><row_{y + 1}_col_{x + 1}>",
                                             add_special=False, parse_special=True)
                out.append(("img", y * gx + x))
            if y != gy - 1:
                out.append(self.nl)
        return out + [self.nlnl, self.fake, self.global_img, ("img", gx * gy), self.fake]


def splice_images(tokenizer, text: str, encoded: list[EncodedImage], first_ids: list[int],
                  layout: Layout) -> tuple[list[int], list[ImageSpan]]:
    """Token ids and image spans for rendered text with one MEDIA_MARKER per image.
    `first_ids`: the tokens of the text before the first marker (encoded by the caller as
    any prompt is: BOS, specials); the rest is tokenized without BOS, specials parsed, as
    libmtmd does."""
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) - 1 != len(encoded):
        raise VisionError(f"the prompt has {len(pieces) - 1} image markers for "
                          f"{len(encoded)} images")
    ids = list(first_ids)
    spans = []
    for enc, piece in zip(encoded, pieces[1:]):
        for item in layout.items(enc):
            if isinstance(item, tuple):
                k = item[1]
                digest = enc.part_digest(k)
                spans.append(ImageSpan(len(ids), enc.parts[k], digest, layout.bidirectional))
                ids.extend(placeholder_ids(digest, int(enc.parts[k].shape[0])))
            else:
                ids.append(item)
        if piece:
            ids.extend(tokenizer.encode(piece, add_special=False, parse_special=True))
    return ids, spans


def load_vision(runner, tokenizer, mmproj: str, backend: str = "cpu") -> VisionEncoder:
    """The projector for a loaded runner, after the checks that it belongs to it: a backend
    that runs image spans, the image tags in the vocabulary, the text width. GGUFError or
    VisionError (one sentence) otherwise; nothing stays open then."""
    if not runner.supports_images:
        raise VisionError(f"the {runner.cfg.arch} architecture does not take image embeddings "
                          f"on the {runner.kind} backend yet (try backend llamacpp)")
    gf, cfg = read_mmproj(mmproj)
    gf.close()
    layout = Layout(tokenizer, cfg)
    check_pair(cfg, runner.cfg.n_embd, runner.cfg.name or "the model")
    enc = VisionEncoder(mmproj, backend, runner=runner)
    enc.layout = layout
    return enc
