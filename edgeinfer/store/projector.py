"""A vision projector (mmproj GGUF) pulled beside its model: a local file, an http(s) URL or
hf://OWNER/REPO/FILE.gguf[@REVISION], checked and stored with the model
(Store.attach_projector)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .model_store import ModelRef, Store


def pull_projector(store: Store, model: str, source: str,
                   on_bytes: Callable[[int, int | None], None] | None = None,
                   policy=None) -> ModelRef:
    """Attach the projector at `source` to the registered model `model`."""
    if "://" not in source:
        return store.attach_projector(model, Path(source))
    import httpx

    from .download import DownloadPolicy, download
    from .pull import _hf_headers, _parse_hf, hf_url
    headers: dict[str, str] = {}
    url = source
    if source.startswith("hf://"):
        repo, file, rev = _parse_hf(source)
        url, headers = hf_url(repo, file, rev), dict(_hf_headers())
    elif not source.startswith(("http://", "https://")):
        from .names import StoreError
        raise StoreError(f"unsupported projector source {source!r}: a local .gguf path, an "
                         "http(s) URL or hf://OWNER/REPO/FILE.gguf")
    store.ensure_dirs()
    tmp = store.new_temp("mmproj-download")
    policy = policy or DownloadPolicy()
    try:
        with httpx.Client(timeout=policy.timeout()) as client:
            download(client, url, tmp, headers, policy, on_bytes or (lambda done, total: None))
        return store.attach_projector(model, tmp, source=source, move=True)
    finally:
        tmp.unlink(missing_ok=True)
