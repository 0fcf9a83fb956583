"""Images as spans of a sequence.

A prompt with images is one token list in which each image is a run of placeholder ids, one
per image token, wrapped in the model's image tags (Gemma 3: <start_of_image> ...
<end_of_image>, as llama.cpp's libmtmd lays them out). A placeholder id is negative (never a
vocabulary id) and derived from the image's content hash, so the prefix cache, which keys
blocks by token ids, keys image blocks by the image: the same image at the same place of the
same prefix reuses its KV, another image never does. The embeddings travel beside the ids
(`ImageSpan`, to the runner in NewRequest.images), and the runner puts them in place of the
token embeddings of those positions.

Inside one image, attention is bidirectional (Gemma 3; llama.cpp decodes an image batch
non-causally): every position of an image sees every position of that image, so the
scheduler never cuts an image across two steps (Sequence.image_spans).

`VisionEncoder` is a loaded projector (mmproj) on a backend: preprocess + encode, with a
small LRU of encoder outputs by content hash (the same image sent again is not re-encoded).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
import numpy as np

from edgeinfer.runners.base import ImageSpan

__all__ = ["ImageSpan", "MEDIA_MARKER", "VisionEncoder", "VisionError", "image_tags",
           "placeholder_id", "splice_images"]

# where an image goes in rendered chat text (llama.cpp's default media marker)
MEDIA_MARKER = "<__media__>"
_PLACEHOLDER_BITS = 28


def placeholder_id(digest: str) -> int:
    """The (negative) token id every position of the image with this sha256 carries."""
    return -(1 + int(digest[:_PLACEHOLDER_BITS // 4], 16))


class VisionError(ValueError):
    """A request or a load the vision path cannot take; one sentence."""


class VisionEncoder:
    """One projector file loaded on a native backend's ops."""

    def __init__(self, path: str, backend: str = "cpu", cache_images: int = 16,
                 runner=None):
        """`runner`: one whose own library encodes images (the llama.cpp runner: libmtmd,
        `runner.image_encoder(path)`); else the native tower on `backend`'s ops."""
        from edgeinfer.formats.mmproj import read_mmproj
        self.path = path
        self.gf, self.cfg = read_mmproj(path)
        self._external = None
        try:
            if runner is not None and hasattr(runner, "image_encoder"):
                self._external = runner.image_encoder(path)
                self.model = None
            else:
                from edgeinfer.models.siglip import SiglipVision
                from edgeinfer.runners.native import make_ops
                # the tower's own ops (its repack choice and per-step caches stay apart from
                # the text model's); torch on the device the text model uses
                ops = make_ops(backend if backend.startswith("torch") else "cpu")
                self.model = SiglipVision(self.cfg, ops, self.gf)
        except BaseException:
            self.gf.close()
            raise
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_images = cache_images
        self.encoded = 0            # images run through the tower (cache misses)
        self.cache_hits = 0

    @property
    def tokens_per_image(self) -> int:
        return self.cfg.tokens_per_image

    @property
    def nbytes(self) -> int:
        return int(self.gf.file_size)

    def encode(self, image) -> np.ndarray:
        """float32 [tokens_per_image, text width] for an edgeinfer.formats.image.Image."""
        from edgeinfer.formats.image import preprocess_fixed
        with self._lock:
            hit = self._cache.get(image.digest)
            if hit is not None:
                self._cache.move_to_end(image.digest)
                self.cache_hits += 1
                return hit
            cfg = self.cfg
            if self._external is not None:
                out = self._external(image.rgb)
            else:
                px = preprocess_fixed(image.rgb, cfg.image_size, cfg.image_mean, cfg.image_std)
                out = self.model.encode(px)
            out.setflags(write=False)
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


def splice_images(tokenizer, text: str, embeddings: list[np.ndarray], digests: list[str],
                  first_ids: list[int]) -> tuple[list[int], list[ImageSpan]]:
    """Token ids and image spans for rendered text with one MEDIA_MARKER per image.
    `first_ids`: the tokens of the text before the first marker (encoded by the caller as
    any prompt is: BOS, specials); the rest is tokenized without BOS, specials parsed, as
    libmtmd does."""
    begin, end = image_tags(tokenizer)
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) - 1 != len(embeddings):
        raise VisionError(f"the prompt has {len(pieces) - 1} image markers for "
                          f"{len(embeddings)} images")
    ids = list(first_ids)
    spans = []
    for emb, digest, piece in zip(embeddings, digests, pieces[1:]):
        ids.append(begin)
        spans.append(ImageSpan(len(ids), emb, digest))
        ids.extend([placeholder_id(digest)] * int(emb.shape[0]))
        ids.append(end)
        if piece:
            ids.extend(tokenizer.encode(piece, add_special=False, parse_special=True))
    return ids, spans


def load_vision(runner, tokenizer, mmproj: str, backend: str = "cpu") -> VisionEncoder:
    """The projector for a loaded runner, after the checks that it belongs to it: a backend
    that runs image spans, the image tags in the vocabulary, the text width. GGUFError or
    VisionError (one sentence) otherwise; nothing stays open then."""
    from edgeinfer.formats.mmproj import check_pair, read_mmproj
    if not getattr(runner, "supports_images", False):
        raise VisionError(f"images need a native backend (cpu or torch); {runner.kind} cannot "
                          f"run them yet (load the model with backend cpu)")
    image_tags(tokenizer)
    gf, cfg = read_mmproj(mmproj)
    gf.close()
    check_pair(cfg, runner.cfg.n_embd, runner.cfg.name or "the model")
    return VisionEncoder(mmproj, backend, runner=runner)
