"""What several commands share: their common options and the model argument's meaning."""
from __future__ import annotations

import argparse
import os

from edgeinfer.formats.gguf_error import GGUFError
from edgeinfer.formats.kv_cache_types import KV_CACHE_TYPES
from edgeinfer.runners.choice import DEVICES, BackendChoiceError, check
from edgeinfer.store.model_store import Store


def resolve_model_file(model: str) -> str:
    """A store name (`gemma3:270m`) or a path to a .gguf file -> the file's path."""
    if model.endswith(".gguf") or os.sep in model or os.path.exists(model):
        if not os.path.exists(model):
            raise GGUFError(f"{model}: file not found")
        return model
    return str(Store().resolve(model).path)


def add_kv_cache_type_arg(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--kv-cache-type", choices=KV_CACHE_TYPES, default=None, help=help_)


def add_device_arg(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--device", choices=DEVICES, default=None, help=help_)


def check_device_args(p: argparse.ArgumentParser, backend: str | None,
                      device: str | None) -> None:
    """A bad --backend name, or a --device that cannot go with it, is a usage error (exit 2)."""
    if backend is None:
        return
    try:
        check(backend, device)
    except BackendChoiceError as e:
        p.error(str(e))
