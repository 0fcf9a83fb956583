"""Models for replicas on nodes that lack them: fetched by sha256 from the head's store.

`BlobServer` is an actor pinned to the head node (where `serve --ray` runs) that reads the
head's model store. A replica whose own store cannot resolve a request's model asks it for
the manifest, copies the blob in 8 MB pieces over Ray's own (token-authenticated) channel
into its store's partial/ directory, checks the sha256, and installs it under the same name
(`Store.install_blob`). A node that shares the head's store (the same directory mounted at
the same path), or that pulled the model itself, never fetches anything.
"""
from __future__ import annotations

import hashlib
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from edgeinfer.store.model_store import ModelNotFound, Store, StoreError

NAME = "edgeinfer-blobs"
NAMESPACE = "edgeinfer"
CHUNK = 8 << 20


@ray.remote(num_cpus=0, max_restarts=-1)
class BlobServer:
    def __init__(self, home: str):
        self.store = Store(home)

    def manifest(self, model: str) -> dict[str, Any] | None:
        try:
            ref = self.store.resolve(model, allow_path=False)
        except StoreError:
            return None
        if not ref.digest:
            return None
        return {"name": ref.full_name, "digest": ref.digest,
                "size": ref.path.stat().st_size, "gguf": ref.manifest.get("gguf") or {}}

    def read(self, digest: str, offset: int, size: int) -> bytes:
        with open(self.store.blob_path(digest), "rb") as f:
            f.seek(offset)
            return f.read(size)


def start_on_this_node(home: str):
    """The BlobServer, on the node this process (the head's `serve --ray`) runs on."""
    here = ray.get_runtime_context().get_node_id()
    return BlobServer.options(
        name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(home)


def lookup():
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def ensure_local(store, model: str, server=None) -> str:
    """Make `model` resolvable in `store`, fetching it from the head when missing. Returns
    what happened: "present", "fetched", "tagged" (blob already here under another name)
    or "unknown" (the head does not have it either: the app answers its 404). Blocking: run
    it in a worker thread."""
    try:
        store.resolve(model, allow_path=False)
        return "present"
    except ModelNotFound:
        pass
    except StoreError:
        return "unknown"            # a malformed name: the app's 400
    server = server or lookup()
    if server is None:
        return "unknown"
    m = ray.get(server.manifest.remote(model))
    if m is None:
        return "unknown"
    digest = m["digest"]
    source = f"ray-head:{m['name']}"
    with store.lock(f"fetch-{digest[:16]}"):
        if store.has_blob(digest):
            store.tag_existing(digest, m["name"], source, m["gguf"])
            return "tagged"
        tmp = store.new_temp(f"fetch-{digest[:12]}")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                offset = 0
                while offset < m["size"]:
                    piece = ray.get(server.read.remote(digest, offset, CHUNK))
                    if not piece:
                        raise StoreError(f"the head's blob sha256-{digest[:12]} ended at "
                                         f"{offset} of {m['size']} bytes")
                    f.write(piece)
                    h.update(piece)
                    offset += len(piece)
            if h.hexdigest() != digest:
                raise StoreError(f"the copy of {m['name']} from the head does not match its "
                                 f"sha256 ({h.hexdigest()[:12]} != {digest[:12]})")
            store.install_blob(tmp, digest, m["name"], source, m["gguf"])
        finally:
            tmp.unlink(missing_ok=True)
    return "fetched"
