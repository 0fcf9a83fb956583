"""Images in API requests: every API's image part becomes raw bytes here (base64 or a
data: URL; http(s) URLs are refused unless the daemon runs with --allow-image-urls /
EDGEINFER_ALLOW_IMAGE_URLS=1: an offline daemon fetches nothing), each image a MEDIA_MARKER
in the message text; fetching, decoding and the projector run on a worker thread while the
prompt is built (edgeinfer.engine.core.Engine.encode_chat_images). Bad images are a 400 in
the calling API's shape."""
from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.engine.core import RequestError
from edgeinfer.engine.images import MEDIA_MARKER
from edgeinfer.formats.image import MAX_IMAGE_BYTES, ImageError, b64_image, decode_image

from .errors import APIError

MAX_IMAGES = 16         # per request


FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ImageRef:
    data: bytes
    param: str          # where in the request it came from, for the error
    url: str | None = None      # an http(s) URL still to fetch (allowed by the daemon)

    def fetched(self) -> "ImageRef":
        """The bytes at `url` (at most MAX_IMAGE_BYTES); a 400 when they cannot be had."""
        if self.url is None:
            return self
        import httpx  # lazy: only a daemon started with --allow-image-urls fetches
        try:
            with httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=True,
                              max_redirects=5, headers={"User-Agent": "edgeinfer"}) as c:
                with c.stream("GET", self.url) as r:
                    if r.status_code != 200:
                        raise bad_image(self.param, f"{self.param}: fetching {self.url} gave "
                                        f"HTTP {r.status_code}")
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        buf += chunk
                        if len(buf) > MAX_IMAGE_BYTES:
                            raise bad_image(self.param, f"{self.param}: the image at "
                                            f"{self.url} is larger than the "
                                            f"{MAX_IMAGE_BYTES // 2**20} MB limit")
        except httpx.HTTPError as e:
            raise bad_image(self.param, f"{self.param}: could not fetch {self.url} "
                            f"({type(e).__name__}: {e})") from None
        return ImageRef(bytes(buf), self.param)


def bad_image(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_image")


def from_b64(data, param: str) -> ImageRef:
    if not isinstance(data, str):
        raise bad_image(param, f"{param} must be a base64 string")
    try:
        return ImageRef(b64_image(data, param), param)
    except ImageError as e:
        raise bad_image(param, str(e)) from None


def from_url(url, param: str, allow_fetch: bool = False) -> ImageRef:
    """An image URL: a data: URL, or an http(s) URL when the daemon allows fetching."""
    if not isinstance(url, str) or not url:
        raise bad_image(param, f"{param} must be a URL string")
    if url.startswith("data:"):
        return from_b64(url, param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https") and allow_fetch:
        return ImageRef(b"", param, url)
    if scheme in ("http", "https"):
        raise bad_image(param, f"{param}: fetching images from http(s) URLs is not enabled on "
                        "this server; send the image inline as a data: URL "
                        "(data:image/png;base64,...)")
    raise bad_image(param, f"{param}: unsupported URL scheme {scheme or url[:20]!r}; send a "
                    "data: URL (data:image/png;base64,...)")


class ImageCollector:
    """Collects a request's images in order; `add()` returns what goes in the text.
    `allow_fetch`: http(s) URLs are fetched (the daemon's allow_image_urls)."""

    def __init__(self, allow_fetch: bool = False):
        self.refs: list[ImageRef] = []
        self.allow_fetch = allow_fetch

    @classmethod
    def for_request(cls, request) -> "ImageCollector":
        cfg = getattr(getattr(request.app.state, "manager", None), "config", None)
        return cls(bool(getattr(cfg, "allow_image_urls", False)))

    def url(self, url, param: str) -> str:
        return self.add(from_url(url, param, self.allow_fetch))

    def add(self, ref: ImageRef) -> str:
        if len(self.refs) >= MAX_IMAGES:
            raise bad_image(ref.param, f"at most {MAX_IMAGES} images per request")
        self.refs.append(ref)
        return MEDIA_MARKER

    def __bool__(self) -> bool:
        return bool(self.refs)


def check_text(text: str, param: str) -> str:
    """Text parts must not carry the marker themselves (it would count as an image)."""
    if isinstance(text, str) and MEDIA_MARKER in text:
        raise APIError(400, f"{param} contains the reserved text {MEDIA_MARKER!r}",
                       param=param, code="invalid_parameter")
    return text


def build_with_images(refs: list[ImageRef], messages: list[dict], param: str = "messages",
                      **extra):
    """A gen.encode() builder: (engine) -> (prompt ids, image spans)."""
    def build(engine):
        if not engine.info.vision:
            raise bad_image(refs[0].param, engine.info.vision_note)
        images = []
        for r in refs:
            r = r.fetched()
            try:
                images.append(decode_image(r.data, r.param))
            except ImageError as e:
                raise bad_image(r.param, str(e)) from None
        try:
            return engine.encode_chat_images(messages, images, **extra)
        except RequestError as e:
            raise APIError(400, str(e), param=param, code="invalid_prompt") from None
    return build
