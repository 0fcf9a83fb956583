"""Every knob of the process in one typed object, read once at the edge.

The CLI and the daemon build a `Settings` from the environment (EDGEINFER_*) with
command-line flags on top, and pass it (or the parts a layer needs) down. Nothing below the
edge reads the environment: a test that wants another setting builds another Settings.

| variable                      | field               | default                             |
|-------------------------------|---------------------|-------------------------------------|
| EDGEINFER_HOME                | home                | the platform's user data dir        |
| EDGEINFER_HOST                | host                | 127.0.0.1:11435                     |
| EDGEINFER_API_KEY             | api_key             | none (required off loopback)        |
| EDGEINFER_BACKEND / _DEVICE   | backend / device    | cpu / none                          |
| EDGEINFER_KEEP_ALIVE          | keep_alive          | 5m                                  |
| EDGEINFER_MEMORY_BUDGET_MB    | memory_budget_bytes | 75% of RAM                          |
| EDGEINFER_MAX_LOADED_MODELS   | max_loaded_models   | 3                                   |
| EDGEINFER_KV_BUDGET_MB        | kv_budget_bytes     | 1024 MB                             |
| EDGEINFER_KV_CACHE_TYPE       | kv_cache_type       | f16 (or q8_0: 34 bytes / 32 values) |
| EDGEINFER_MAX_RUNNING_SEQS    | max_running_seqs    | 16                                  |
| EDGEINFER_MAX_QUEUE           | max_queue           | 64                                  |
| EDGEINFER_MAX_MODEL_LEN       | max_model_len       | min(model's, 8192)                  |
| EDGEINFER_THREADS             | threads             | governed (cores other programs leave)|
| EDGEINFER_REPACK              | repack              | per model (int8 tiles on AVX2+ CPUs) |
| EDGEINFER_BATCH_INVARIANT     | batch_invariant     | off                                 |
| EDGEINFER_TORCH_DTYPE         | torch_dtype         | the device's choice                 |
| EDGEINFER_TORCH_GRAPHS        | torch_graphs        | on (CUDA: decode steps as graphs)   |
| EDGEINFER_SPECULATIVE         | speculative         | on (prompt-lookup drafts, batch <= 2)|
| EDGEINFER_HF_ENDPOINT / HF_TOKEN | hf_endpoint / hf_token | huggingface.co / none        |
| EDGEINFER_DEBUG               | debug               | off                                 |
| EDGEINFER_ALLOW_IMAGE_URLS    | allow_image_urls    | off (images only inline, base64)    |
| EDGEINFER_ENGINE_PROCESS      | engine_process      | on (each model's engine in its own process) |
| EDGEINFER_SPARE_RUNNER        | spare_runner        | on (a warm engine process for the next load) |
| EDGEINFER_REPACK_CACHE        | repack_cache        | <user cache>/edgeinfer/repacked (0: off) |
| EDGEINFER_REPACK_CACHE_GB     | repack_cache_bytes  | 8 GB (least recently used models go first) |
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from edgeinfer.formats.kv_cache_types import (  # noqa: F401 (the settings' names too)
    KV_BYTES_PER_VALUE, KV_CACHE_TYPES, check_kv_cache_type)

DEFAULT_KEEP_ALIVE = 300.0
DEFAULT_KV_BUDGET = 1 << 30
DEFAULT_REPACK_CACHE_BYTES = 8 << 30


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: float | int | str) -> float:
    """Seconds from a number or a Go duration ("5m", "1h30m", "0"), as Ollama's keep_alive;
    negative means forever (math.inf). ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError("a duration must be like \"5m\" or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        s = value.strip()
        neg = s.startswith("-")
        s = s.lstrip("+-")
        try:
            seconds = float(s)
        except ValueError:
            parts = _DURATION.findall(s)
            if not parts or "".join(a + b for a, b in parts) != s:
                raise ValueError(f"{value!r} is not a duration like \"5m\", \"30s\" or "
                                 "\"1h\"") from None
            seconds = sum(float(a) * _UNIT[b] for a, b in parts)
        seconds = -seconds if neg else seconds
    return float("inf") if seconds < 0 else seconds


class SettingsError(ValueError):
    """A setting with a value that cannot be used; the message names the variable."""



def _num(env: Mapping[str, str], name: str, default, scale: int = 1, kind=int):
    v = env.get(name, "").strip()
    if not v:
        return default
    try:
        x = float(v) * scale
    except ValueError:
        raise SettingsError(f"{name}={v!r} is not a number") from None
    if x < 0:
        raise SettingsError(f"{name}={v!r} must not be negative")
    return kind(x)


def _kv_type(env: Mapping[str, str]) -> str:
    v = env.get("EDGEINFER_KV_CACHE_TYPE", "").strip().lower()
    if not v:
        return "f16"
    try:
        return check_kv_cache_type(v, "EDGEINFER_KV_CACHE_TYPE")
    except ValueError as e:
        raise SettingsError(str(e)) from None


def _repack_cache(env: Mapping[str, str]) -> str | None:
    """EDGEINFER_REPACK_CACHE: a directory, or 0/off; unset: repacked/ in the user's cache
    directory, beside numba's (derived data: deleting it costs the next load a repack)."""
    v = env.get("EDGEINFER_REPACK_CACHE", "").strip()
    if v.lower() in ("0", "false", "no", "off"):
        return None
    if v and v.lower() not in ("1", "true", "yes", "on"):
        return str(Path(v).expanduser())
    from platformdirs import user_cache_dir
    return str(Path(user_cache_dir("edgeinfer")) / "repacked")


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    v = env.get(name, "").strip().lower()
    if not v:
        return None
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={v!r} is not 0 or 1")


@dataclass(frozen=True)
class Settings:
    home: Path | None = None
    host: str | None = None
    api_key: str | None = None
    backend: str = "cpu"
    device: str | None = None
    keep_alive: float = DEFAULT_KEEP_ALIVE
    memory_budget_bytes: int = 0            # 0 = 75% of physical memory
    max_loaded_models: int = 3
    kv_budget_bytes: int = DEFAULT_KV_BUDGET
    kv_cache_type: str = "f16"
    max_running_seqs: int = 16
    max_queue: int = 64
    max_model_len: int | None = None
    threads: int | None = None              # None = the thread governor decides per step
    repack: bool | None = None              # None = per model
    batch_invariant: bool = False
    torch_dtype: str | None = None
    torch_graphs: bool = True
    speculative: bool = True
    hf_endpoint: str | None = None
    hf_token: str | None = None
    debug: bool = False
    backend_set: bool = False               # backend came from the environment or a flag
    allow_image_urls: bool = False          # the daemon fetches http(s) image URLs
    engine_process: bool = True             # each loaded model's engine in its own process
    spare_runner: bool = True               # a warm engine process waits for the next load
    repack_cache: str | None = None         # repacked CPU weights kept here (None: off)
    repack_cache_bytes: int = DEFAULT_REPACK_CACHE_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """The environment's values, then `overrides` (flags; None means "not given")."""
        env = os.environ if env is None else env
        try:
            ka = env.get("EDGEINFER_KEEP_ALIVE", "").strip()
            keep_alive = parse_duration(ka) if ka else DEFAULT_KEEP_ALIVE
        except ValueError as e:
            raise SettingsError(f"EDGEINFER_KEEP_ALIVE: {e}") from None
        home = env.get("EDGEINFER_HOME", "").strip()
        s = cls(
            home=Path(home).expanduser() if home else None,
            host=env.get("EDGEINFER_HOST") or None,
            api_key=env.get("EDGEINFER_API_KEY") or None,
            backend=env.get("EDGEINFER_BACKEND") or "cpu",
            backend_set=bool(env.get("EDGEINFER_BACKEND")),
            device=env.get("EDGEINFER_DEVICE") or None,
            keep_alive=keep_alive,
            memory_budget_bytes=_num(env, "EDGEINFER_MEMORY_BUDGET_MB", 0, 1 << 20),
            max_loaded_models=_num(env, "EDGEINFER_MAX_LOADED_MODELS", 3),
            kv_budget_bytes=_num(env, "EDGEINFER_KV_BUDGET_MB", DEFAULT_KV_BUDGET, 1 << 20),
            kv_cache_type=_kv_type(env),
            max_running_seqs=_num(env, "EDGEINFER_MAX_RUNNING_SEQS", 16),
            max_queue=_num(env, "EDGEINFER_MAX_QUEUE", 64),
            max_model_len=_num(env, "EDGEINFER_MAX_MODEL_LEN", None),
            threads=_num(env, "EDGEINFER_THREADS", None) or None,
            repack=_flag(env, "EDGEINFER_REPACK"),
            batch_invariant=bool(_flag(env, "EDGEINFER_BATCH_INVARIANT")),
            torch_dtype=env.get("EDGEINFER_TORCH_DTYPE") or None,
            torch_graphs=_flag(env, "EDGEINFER_TORCH_GRAPHS") is not False,
            speculative=_flag(env, "EDGEINFER_SPECULATIVE") is not False,
            hf_endpoint=env.get("EDGEINFER_HF_ENDPOINT") or None,
            hf_token=env.get("HF_TOKEN") or None,
            debug=bool(env.get("EDGEINFER_DEBUG")),
            allow_image_urls=bool(_flag(env, "EDGEINFER_ALLOW_IMAGE_URLS")),
            engine_process=_flag(env, "EDGEINFER_ENGINE_PROCESS") is not False,
            spare_runner=_flag(env, "EDGEINFER_SPARE_RUNNER") is not False,
            repack_cache=_repack_cache(env),
            repack_cache_bytes=_num(env, "EDGEINFER_REPACK_CACHE_GB", DEFAULT_REPACK_CACHE_BYTES,
                                    1 << 30),
        )
        return s.with_overrides(**overrides)

    def with_overrides(self, **overrides) -> "Settings":
        names = {f.name for f in fields(self)}
        unknown = set(overrides) - names
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        if overrides.get("kv_cache_type") is not None:
            try:
                check_kv_cache_type(overrides["kv_cache_type"], "--kv-cache-type")
            except ValueError as e:
                raise SettingsError(str(e)) from None
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


_current: Settings | None = None


def current() -> Settings:
    """The process's settings: the ones the edge installed (the CLI and the daemon do, once,
    at start). Without an edge (a script, a test) the environment as it is now."""
    return _current if _current is not None else Settings.from_env()


def install(settings: Settings | None) -> Settings | None:
    """Make `settings` the process's (None: back to reading the environment)."""
    global _current
    _current = settings
    return settings
