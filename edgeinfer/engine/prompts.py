"""A loaded model's prompt side: chat template, tokenizer and image layout.

Messages become token ids here (and images become spans of placeholder ids). It needs the
GGUF's metadata only, never the weights, so the daemon builds one for a model whose engine
runs in another process (edgeinfer.engine.remote) and the in-process Engine builds the same.
"""
from __future__ import annotations

from typing import Any, Callable

from edgeinfer.engine.images import MEDIA_MARKER, EncodedImage, Layout, VisionError, splice_images
from edgeinfer.engine.requests import RequestError
from edgeinfer.formats.chat_template import (ChatFormat, builtin_name_for, chat_template_for,
                                             encode_prompt, special_token_strings)


def chat_format(metadata: dict[str, Any], arch: str | None) -> ChatFormat:
    """The model's template (its own, else the built-in one for its family), not compiled
    here: a template that cannot render fails the chat requests, not the load."""
    own = metadata.get("tokenizer.chat_template")
    has_own = isinstance(own, str) and bool(own.strip())
    specials = special_token_strings(metadata)
    return ChatFormat(template=chat_template_for(metadata, arch),
                      bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                      builtin=None if has_own else builtin_name_for(metadata, arch))


class PromptMethods:
    """An engine handle's prompt methods (the in-process Engine's and RemoteEngine's alike),
    answered by its Prompter, `self.prompts`."""
    prompts: "Prompter"

    @property
    def chat_template(self) -> str:
        return self.prompts.chat_template

    @property
    def has_own_template(self) -> bool:
        return self.prompts.has_own_template

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return self.prompts.render(messages, add_generation_prompt, **extra)

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return self.prompts.encode_chat(messages, **extra)

    def encode_raw(self, text: str) -> list[int]:
        return self.prompts.encode_raw(text)

    def encode_chat_images(self, messages: list[dict], images: list, **extra):
        """(token ids, ImageSpans): Prompter.encode_chat_images."""
        return self.prompts.encode_chat_images(messages, images, **extra)


class Prompter:
    """Messages -> token ids for one model. `encode_image` turns an
    edgeinfer.formats.image.Image into its EncodedImage (the projector, wherever it runs);
    `layout` says how images sit among the tokens. Both None for a text-only model, and then
    `no_images` is the sentence an image request gets."""

    def __init__(self, tokenizer, fmt: ChatFormat, layout: Layout | None = None,
                 encode_image: Callable[[Any], EncodedImage] | None = None,
                 no_images: str = ""):
        self.tokenizer = tokenizer
        self.format = fmt
        self.layout = layout
        self.encode_image = encode_image
        self.no_images = no_images

    @property
    def chat_template(self) -> str:
        return self.format.template

    @property
    def has_own_template(self) -> bool:
        """False for a base model: the GGUF has no template and a built-in one stands in."""
        return self.format.builtin is None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return self.format.render(messages, add_generation_prompt, **extra)

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return encode_prompt(self.tokenizer, self.render(messages, **extra))

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def encode_chat_images(self, messages: list[dict], images: list, **extra):
        """(token ids, ImageSpans) for messages whose text holds one images.MEDIA_MARKER per
        image of `images` (in order), each encoded by the projector (its LRU skips images
        seen lately). RequestError for a model without a projector."""
        if self.encode_image is None or self.layout is None:
            raise RequestError(self.no_images)
        text = self.render(messages, **extra)
        first = encode_prompt(self.tokenizer, text.partition(MEDIA_MARKER)[0])
        encoded = [self.encode_image(im) for im in images]
        try:
            return splice_images(self.tokenizer, text, encoded, first, self.layout)
        except VisionError as e:
            raise RequestError(str(e)) from None
