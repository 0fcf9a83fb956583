"""Model names: parsing and the one rule for what a name may contain.

A model name is `[namespace/]model[:tag]`. Every part (namespace, model, tag) is 1 to 64
characters from `a-z 0-9 . _ -`, starts with a letter or a digit and never contains `..`.
Names are case-insensitive (stored lower-case) so that two names never collide on a
case-insensitive filesystem. The namespace defaults to `library` and the tag to `latest`,
as in Ollama. Because of this rule a name can only ever become the path
`manifests/<namespace>/<model>/<tag>.json` inside the store, never a path outside it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
NAME_RULE = ("a model name is [namespace/]model[:tag]; each part is 1-64 characters from "
             "a-z, 0-9, '.', '_' and '-', starts with a letter or digit and has no '..'")

_PART = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class StoreError(Exception):
    """Anything the model store refuses or cannot do. The message is one sentence."""


class InvalidModelName(StoreError):
    pass


class ModelNotFound(StoreError):
    pass


@dataclass(frozen=True)
class ModelName:
    namespace: str
    model: str
    tag: str

    @property
    def name(self) -> str:
        """The name without tag, namespace omitted when it is the default one."""
        if self.namespace == DEFAULT_NAMESPACE:
            return self.model
        return f"{self.namespace}/{self.model}"

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


def _check_part(part: str, what: str, original: str) -> str:
    if not _PART.fullmatch(part) or ".." in part:
        raise InvalidModelName(f"invalid model name {original!r} ({what} {part!r}): {NAME_RULE}")
    return part


def parse_name(text: str) -> ModelName:
    """Parse `[namespace/]model[:tag]`; raise InvalidModelName with the rule when it breaks it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidModelName(f"empty model name: {NAME_RULE}")
    original = text
    text = text.strip().lower()
    base, sep, tag = text.rpartition(":")
    if not sep:
        base, tag = text, DEFAULT_TAG
    parts = base.split("/")
    if len(parts) == 1:
        namespace, model = DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        namespace, model = parts
    else:
        raise InvalidModelName(f"invalid model name {original!r} (more than one '/'): {NAME_RULE}")
    return ModelName(_check_part(namespace, "namespace", original),
                     _check_part(model, "model", original),
                     _check_part(tag, "tag", original))


def name_from_filename(filename: str) -> ModelName:
    """A valid default name for a downloaded or imported file (`Foo-Q4_K_M.gguf` ->
    `foo-q4_k_m:latest`)."""
    stem = filename.rsplit("/", 1)[-1]
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    stem = re.sub(r"[^a-z0-9._-]+", "-", stem.lower())
    stem = re.sub(r"\.{2,}", ".", stem).strip("._-")[:64] or "model"
    return parse_name(stem)
