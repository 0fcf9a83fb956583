"""Test files built once into a cache that several pytest workers share."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def build_once(path: Path, write: Callable[[Path], object]) -> Path:
    """path, written by write(tmp) the first time: each process writes a file of its own and
    renames it into place, so two workers (pytest -n) building the same file at once never
    read or clobber a half-written one (the last rename wins; both wrote the same bytes)."""
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
