"""The bundled models (bundled.py: qwen2.5-coder:0.5b, gemma3:270m) in every model list.

`Store.resolve(name)` registers a bundled package on first use, so before anything asked for
it by name a fresh store listed nothing: /api/tags, /v1/models, `edgeinfer list` and the
terminal app's model list were empty while `run gemma3:270m` worked. `list_models()`
registers them the first time a store is listed (assembling each file once, a few seconds),
and leaves a marker so a user who later removes one (`edgeinfer rm gemma3:270m`) does not see
it come back.
"""
from __future__ import annotations

import logging

from .bundled import BUNDLED
from .model_store import ModelRef, Store, StoreError

log = logging.getLogger("edgeinfer.store")
MARKER = ".bundled-registered"


def list_models(store: Store) -> list[ModelRef]:
    """store.list(), with the bundled models registered first if this store never had them."""
    marker = store.home / MARKER
    if not marker.exists():
        for b in BUNDLED.values():
            if not b.available():
                continue
            try:
                if store.get(b.name) is None:
                    store.ensure_bundled(b.name)
            except (StoreError, OSError) as e:     # a list must still answer
                log.warning("could not register the bundled model %s: %s", b.name, e)
        try:
            store.home.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError as e:
            log.warning("could not write %s: %s", marker, e)
    return store.list()
