"""The bundled default model (gemma3:270m) in every model list.

`Store.resolve("gemma3:270m")` registers the bundled package on first use, so before anything
asked for it by name a fresh store listed nothing: /api/tags, /v1/models, `edgeinfer list`
and the terminal app's model list were empty while `run gemma3:270m` worked. `list_models()`
registers it the first time a store is listed (assembling the 253 MB file once, a few
seconds), and leaves a marker so a user who later removes it (`edgeinfer rm gemma3:270m`)
does not see it come back.
"""
from __future__ import annotations

import logging

from .model_store import BUNDLED_NAME, ModelRef, Store, StoreError, bundled_available

log = logging.getLogger("edgeinfer.store")
MARKER = ".bundled-registered"


def list_models(store: Store) -> list[ModelRef]:
    """store.list(), with the bundled default registered first if this store never had it."""
    marker = store.home / MARKER
    if not marker.exists() and bundled_available():
        try:
            if store.get(BUNDLED_NAME) is None:
                store.ensure_bundled()
            store.home.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except (StoreError, OSError) as e:     # a list must still answer
            log.warning("could not register the bundled model %s: %s", BUNDLED_NAME, e)
    return store.list()
