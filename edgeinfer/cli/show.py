"""`edgeinfer show MODEL`: what a GGUF file holds, validated, without loading weights."""
from __future__ import annotations

import argparse
import os

from typing import TYPE_CHECKING

from edgeinfer.cli.args import add_kv_cache_type_arg, resolve_model_file
from edgeinfer.formats.gguf_error import GGUFError
from edgeinfer.settings import KV_BYTES_PER_VALUE, current

if TYPE_CHECKING:
    from edgeinfer.formats.model_config import ModelSummary


def load_summary(path: str) -> ModelSummary:
    # lazy: the reader's numpy and gguf imports are not every command's start-up
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config, summarize
    try:
        f = read_gguf(path)
        summary = summarize(f)
        if summary.native:
            load_model_config(f)   # full tensor/shape validation for the archs we run
        f.close()
        return summary
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def loaded_copies(model: str) -> list[dict]:
    """The daemon's loaded copies of a store model (its /api/ps entries), or [] when no
    daemon answers or `model` is a file path. Never starts a daemon."""
    if model.endswith(".gguf") or os.sep in model or os.path.exists(model):
        return []
    from edgeinfer.cli.client import ClientError, connect
    from edgeinfer.store.model_store import Store, StoreError
    try:
        full = Store().resolve(model).full_name
        with connect(autostart=False) as c:
            models = c.request("GET", "/api/ps")["models"]
    except (ClientError, StoreError, KeyError, TypeError):
        return []
    return [m for m in models if m.get("name") == full]


def placement_rows(s: ModelSummary, loaded: list[dict]) -> list[tuple[str, str]]:
    """backend/weights rows: each loaded copy's, else what `--backend auto` would pick here
    and how that backend would hold the weights."""
    from edgeinfer.runners.choice import BackendChoiceError, describe_weights, resolve
    rows = []
    for m in loaded:
        b = m.get("backend") or "?"
        fmt = m.get("weights_format") or "?"
        rows += [("backend", f"{b} (loaded in the daemon)"),
                 ("weights", describe_weights(b, fmt))]
    if rows:
        return rows
    try:
        b = resolve("auto", None, s.arch, getattr(s, "native", True), getattr(s, "cpu_only", False))
    except BackendChoiceError as e:
        return [("backend", f"auto cannot choose: {e}")]
    settings = current()
    return [("backend", f"{b} (not loaded; what --backend auto picks on this machine)"),
            ("weights", describe_weights(b, path=s.path, repack=settings.repack,
                                         torch_dtype=settings.torch_dtype))]


def kv_row(s: ModelSummary, backend: str | None,
           kv_cache_type: str | None = None) -> tuple[str, str]:
    """KV bytes per token as the backend that runs the model stores them: f16 (the numba
    CPU pool and llama.cpp by default), q8_0 (34 bytes per 32 values) with --kv-cache-type
    or EDGEINFER_KV_CACHE_TYPE, torch's f16/bf16; f16 when no backend is known."""
    settings = current()
    name = kv_cache_type or settings.kv_cache_type
    per_value = KV_BYTES_PER_VALUE.get(name, 2)
    if backend is not None:
        try:
            from edgeinfer.runners.choice import estimate_memory
            est = estimate_memory(backend, s.path, name, settings.repack, settings.torch_dtype)
            per_value, name = est.kv_bytes_per_value, est.kv_cache_type
        except Exception:       # a prediction only: never fail `show` over it
            backend = None
    where = f"{name} on {backend}" if backend else name
    if not (s.n_layers and s.n_kv_head and s.head_dim):
        return "KV cache", "-"
    per_token = round(2 * s.n_layers * s.n_kv_head * s.head_dim * per_value)
    per_value_s = "34/32" if name == "q8_0" else f"{per_value:g}"
    text = (f"{per_token:,} bytes/token ({where}) = 2 x {s.n_layers} layers x "
            f"{s.n_kv_head} KV heads x {s.head_dim} head dim x {per_value_s} bytes")
    if backend is not None and backend.partition(":")[0] == "cpu":
        from edgeinfer.runners.base import window_note
        text += window_note(s.path, per_value)
    return "KV cache", text


def _auto_backend(s: ModelSummary) -> str | None:
    from edgeinfer.runners.choice import BackendChoiceError, resolve
    try:
        return resolve("auto", None, s.arch, s.native, s.cpu_only)
    except BackendChoiceError:
        return None


def format_summary(s: ModelSummary, model: str,
                   placement: list[tuple[str, str]] | None = None,
                   backend: str | None = None, kv_cache_type: str | None = None) -> str:
    rows = [
        ("architecture", s.arch + ("" if s.native else "  (not native: use --backend llamacpp)")),
        ("name", s.name or "-"),
        ("parameters", f"{_human_count(s.n_params)} ({s.n_params:,})"),
        ("file type", s.file_type),
        ("quantization", ", ".join(f"{k} x{v}" for k, v in s.quant_counts.items())),
        ("context length", str(s.context_length or "-")),
        ("embedding length", str(s.n_embd or "-")),
        ("layers", str(s.n_layers or "-")),
        ("heads / KV heads", f"{s.n_head or '-'} / {s.n_kv_head or '-'}"),
        ("head dim", str(s.head_dim or "-")),
        ("vocabulary", f"{s.vocab_size:,} ({s.tokenizer} tokenizer)"),
        ("chat template", "yes" if s.has_chat_template else "no (built-in template for the architecture)"),
        kv_row(s, backend, kv_cache_type),
        ("file size", f"{_human_bytes(s.file_size)} ({s.file_size:,} bytes)"),
        ("file", s.path),
        *(placement or []),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"  Model {model}"] + [f"    {k:<{width}}  {v}" for k, v in rows])


def cmd_show(args: argparse.Namespace) -> int:
    path = resolve_model_file(args.model)
    summary = load_summary(path)
    loaded = loaded_copies(args.model)
    backend = loaded[0].get("backend") if loaded else _auto_backend(summary)
    kv_type = (loaded[0].get("kv_cache_type") if loaded else None) or args.kv_cache_type
    print(format_summary(summary, args.model,
                         placement_rows(summary, loaded) + projector_rows(args.model),
                         backend, kv_type))
    return 0


def projector_rows(model: str) -> list[tuple[str, str]]:
    """The vision projector stored with a store model (edgeinfer pull --mmproj)."""
    if model.endswith(".gguf") or os.sep in model or os.path.exists(model):
        return [("vision", "no projector (a file path; run it with --mmproj FILE)")]
    from edgeinfer.store.model_store import Store
    try:
        proj = Store().resolve(model).manifest.get("projector")
    except Exception:       # a description only
        return []
    if not isinstance(proj, dict):
        return [("vision", "no (text only; add a projector with pull --mmproj FILE)")]
    size = proj.get("image_size")
    what = (f"{size}x{size} tile (images scaled to {proj['longest_edge']} px, cut into tiles, "
            f"plus an overview)" if proj.get("longest_edge") else f"{size}x{size} image")
    return [("vision", f"{proj.get('projector_type')} projector, "
                       f"{proj.get('tokens_per_image')} tokens per {what}, "
                       f"{_human_bytes(int(proj.get('size') or 0))}"),
            ("projector", str(proj.get("path") or proj.get("digest")))]


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("show", help="show a model's architecture, quantization and sizes")
    p.add_argument("model", help="a store name (gemma3:270m) or a path to a .gguf file")
    add_kv_cache_type_arg(p, "the KV cache type to size the KV row for (default: the loaded "
                             "copy's, else EDGEINFER_KV_CACHE_TYPE, else f16)")
    p.set_defaults(func=cmd_show)
