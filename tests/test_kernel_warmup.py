"""Kernels compiled ahead of the first request (edgeinfer/engine/warmup.py), and the progress
a load or a pull that compiles shows: /api/ps and /api/stats, `edgeinfer ps`, `edgeinfer
pull`'s bar, the TUI's parsing.

The steps here run against the test JIT cache (NUMBA_CACHE_DIR, which install or earlier
tests warmed): what they compile is loaded from it, and only the step markers are fresh
(EDGEINFER_WARM_MARKERS points at an empty directory), so every step runs, quickly. How
long a cold compile takes is measured by benchmarks/first_request.py, not here.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from edgeinfer.engine import warmup
from daemon_fixture import REPO, daemon_env, start_daemon


@pytest.fixture()
def fresh_markers(tmp_path, monkeypatch):
    d = tmp_path / "markers"
    monkeypatch.setenv("EDGEINFER_WARM_MARKERS", str(d))
    return d


def test_a_model_needs_its_weight_types_and_its_family_forward(smollm2_path, qwen_coder_path,
                                                                gemma3_path):
    from edgeinfer.backends.cpu._int8 import HAVE_SIMD
    if not HAVE_SIMD:
        pytest.skip("without a vector tile kernel the default keeps weights in GGUF blocks")
    assert warmup.keys_for_model(str(smollm2_path)) == [
        "int8:Q4_1", "int8:Q8_0", "attention:f16", "model:llama:f16"]
    assert warmup.keys_for_model(str(qwen_coder_path)) == [
        "int8:Q5_0", "int8:Q8_0", "int8:Q4_K", "int8:Q6_K", "attention:f16", "model:qwen2:f16"]
    assert warmup.keys_for_model(str(gemma3_path), kv_cache_type="q8_0")[-2:] == \
        ["attention:q8_0", "model:gemma3:q8_0"]
    # weights kept in their GGUF blocks: the block kernels (with ggml's activation rounding)
    assert warmup.keys_for_model(str(smollm2_path), repack=False) == [
        "float:Q4_1", "float:Q8_0", "ops", "attention:f16", "model:llama:f16"]
    # install covers every weight type and family a default load needs
    install = set(warmup.install_keys())
    for path in (smollm2_path, qwen_coder_path, gemma3_path):
        assert set(warmup.keys_for_model(str(path))) <= install


def test_install_runs_shared_kernels_first_then_two_processes():
    stages = warmup._stages(warmup.install_keys(), 2)
    assert stages[0] == [["int8:Q8_0"], ["float:F32"]]
    assert stages[1][0] == ["attention:f16", "attention:q8_0"]
    assert all(k.startswith("model:") for part in stages[2] for k in part)
    assert all(len(stage) <= 2 for stage in stages)
    assert sorted(k for stage in stages for part in stage for k in part) == \
        sorted(warmup.install_keys())
    assert warmup._stages(["int8:Q4_1", "model:llama:f16"], 1) == \
        [[["int8:Q4_1", "model:llama:f16"]]]


def test_prepare_runs_each_pending_step_once_with_progress(fresh_markers):
    seen: list[warmup.Progress] = []
    assert warmup.pending(["int8:Q8_0", "int8:Q8_0"]) == ["int8:Q8_0"]
    assert warmup.prepare(["int8:Q8_0"], seen.append) == ["int8:Q8_0"]
    assert [(p.done, p.total) for p in seen] == [(0, 1), (0, 1), (1, 1)]
    assert seen[1].label == "int8 tile kernel Q8_0"          # started
    assert seen[-1].text == "compiling kernels (1/1)"
    assert warmup.is_done("int8:Q8_0") and warmup.pending(["int8:Q8_0"]) == []
    assert warmup.prepare(["int8:Q8_0"], seen.append) == []     # done: nothing runs
    assert len(seen) == 3


def test_a_failing_step_is_reported_not_marked(fresh_markers):
    with pytest.raises(warmup.WarmupError, match="no kernel step"):
        warmup.prepare(["nonsense:step"])
    assert not warmup.is_done("nonsense:step")


def test_markers_follow_the_kernel_sources(fresh_markers, monkeypatch):
    warmup.prepare(["int8:Q8_0"])
    assert warmup.is_done("int8:Q8_0")
    monkeypatch.setattr(warmup, "sources_hash", lambda: "an-edited-kernel")
    assert not warmup.is_done("int8:Q8_0")


def test_markers_follow_where_and_when_the_sources_were_written(tmp_path):
    """numba keys its cache on a source file's directory, time and size as well as its
    content: a second checkout of the same kernels (install.sh in a fresh clone), or the
    same file written again, has no compiled kernels, so its steps are not done."""
    import os
    a, b = tmp_path / "a" / "k.py", tmp_path / "b" / "k.py"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text("def kernel(): pass\n")
        os.utime(f, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    h = warmup.files_hash("v", [a])
    assert h == warmup.files_hash("v", [a])
    assert h != warmup.files_hash("v", [b])               # same content, another checkout
    assert h != warmup.files_hash("w", [a])               # another numba / CPU
    os.utime(a, ns=(1_700_000_001_000_000_000, 1_700_000_001_000_000_000))
    assert h != warmup.files_hash("v", [a])               # written again
    hb = warmup.files_hash("v", [b])
    b.write_text("def kernel(): p4ss\n")                 # edited: same size, same time
    os.utime(b, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert warmup.files_hash("v", [b]) != hb


def test_markers_cover_every_kernel_module_of_the_serving_core():
    """Every module under edgeinfer/ that defines a numba kernel is among the sources the
    markers hash (backends/cpu and models/ are hashed whole): an edited kernel there must
    not read as compiled."""
    import re
    root = REPO / "edgeinfer"
    defining = {".".join(p.relative_to(REPO).with_suffix("").parts)
                for p in root.rglob("*.py")
                if re.search(r"^@(numba\.)?(njit|jit|vectorize|guvectorize)\b",
                             p.read_text(), re.M)}
    assert defining == set(warmup.KERNEL_MODULES)


def test_ps_table_shows_a_load_in_progress():
    from edgeinfer.cli.manage import format_ps
    table = format_ps([{"name": "smollm2:test", "digest": "", "size": 0, "backend": "cpu",
                        "state": "loading", "load_progress": {
                            "stage": "compiling kernels", "text": "compiling kernels (2/3)",
                            "done": 2, "total": 3}}])
    assert "compiling kernels (2/3)" in table


def test_tui_reads_load_progress_from_ps_and_stats():
    from tui.api import loading_status, parse_loaded, parse_stats
    m = parse_loaded({"name": "smollm2:test", "state": "loading", "load_progress": {
        "stage": "compiling kernels", "text": "compiling kernels (1/3)",
        "step": "int8 tile kernel Q4_1"}})
    assert m.status == "compiling kernels (1/3): int8 tile kernel Q4_1"
    s = parse_stats({"models": [], "loading": [{"name": "smollm2:test", "backend": "cpu",
                                                "stage": "loading weights",
                                                "text": "loading weights"}]})
    assert loading_status(s.models, "smollm2:test") == "loading weights"
    assert loading_status(parse_stats({"models": [{"name": "x:y"}]}).models, "x:y") is None


def test_api_ps_shows_kernels_compiling_while_a_new_model_loads(tmp_path, smollm2_path):
    """A model whose kernels no install or pull prepared: its first request compiles them
    before loading, and /api/ps (and /api/stats) say so, step by step."""
    from edgeinfer.store.model_store import Store
    home = tmp_path / "home"
    Store(home).register_file(smollm2_path, "smollm2:test")
    markers = tmp_path / "markers"
    d = start_daemon(home, EDGEINFER_WARM_MARKERS=str(markers))
    seen: list[dict] = []
    stats_seen: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for m in d.get("/api/ps").json()["models"]:
                if m.get("state") == "loading":
                    seen.append(m["load_progress"])
            stats_seen.extend(d.stats().get("loading") or [])
            time.sleep(0.02)
    th = threading.Thread(target=poll, daemon=True)
    try:
        th.start()
        r = d.post("/api/generate", {"model": "smollm2:test", "prompt": "Hi", "stream": False,
                                     "options": {"temperature": 0, "num_predict": 2}})
        stop.set()
        th.join()
        assert r.status_code == 200, r.text
        compiling = [p for p in seen if p["stage"] == "compiling kernels"]
        assert compiling, seen
        assert {p["total"] for p in compiling} == {4}
        done = [p["done"] for p in compiling]
        assert done == sorted(done) and done[0] < 4
        assert all(p["text"] == f"compiling kernels ({p['done']}/4)" for p in compiling)
        assert any(p["stage"] == "compiling kernels" for p in stats_seen)
        ps = d.get("/api/ps").json()["models"]
        assert [(m["name"], m["state"]) for m in ps] == [("smollm2:test", "loaded")]
        assert len(list(markers.rglob("*"))) == 1 + 4      # the hash directory, 4 markers
        assert "compiling 4 kernel steps for smollm2:test" in d.log_text()
    finally:
        stop.set()
        d.stop()


def test_pull_prepares_the_models_kernels_with_a_progress_bar(tmp_path, smollm2_path):
    env = daemon_env(tmp_path / "home", EDGEINFER_WARM_MARKERS=str(tmp_path / "markers"),
                     EDGEINFER_HOST="127.0.0.1:9")       # no daemon: a local import
    cmd = [sys.executable, "-m", "edgeinfer", "pull", str(smollm2_path), "--name", "s:t"]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "pulled s:t" in r.stdout
    assert "compiling kernels" in r.stderr and "4/4" in r.stderr, r.stderr
    again = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compiling kernels" not in again.stderr
