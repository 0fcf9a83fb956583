"""Repacked weights kept on disk (backends/cpu/packed_cache.py): a model's next load maps
the tiles its first load wrote, with the same bits; a damaged file, a full or unwritable
directory and the size limit each leave the model served as before."""
from __future__ import annotations

import logging
import os

import numpy as np

from edgeinfer.backends.cpu import packed_cache as pc
from edgeinfer.backends.cpu.repack import PackedMatrix
from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.settings import Settings

import synth
from conftest import CACHE as TEST_MODELS

CACHE = TEST_MODELS / "synth"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = "def quicksort(xs):"


def _load(path, root, limit=8 << 30):
    e = Engine(str(path), EngineConfig(backend="cpu", repack_cache=str(root) if root else None,
                                       repack_cache_bytes=limit))
    out = e.generate(e.encode_raw(PROMPT), GREEDY).token_ids
    cache = e.runner.ops.packed_cache
    if cache is not None:
        cache.flush()
    mats = {k: v for k, v in _matrices(e.runner.model)}
    e.shutdown()
    return out, cache, mats


def _matrices(model):
    """(name, PackedMatrix) of every repacked matrix the model holds."""
    seen = set()
    stack = [("", model)]
    while stack:
        prefix, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, PackedMatrix):
            yield prefix, obj
        elif isinstance(obj, (list, tuple)):
            stack.extend((f"{prefix}[{i}]", x) for i, x in enumerate(obj))
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("models", "edgeinfer")):
            stack.extend((f"{prefix}.{k}", v) for k, v in vars(obj).items())


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        for f in ("q", "h", "s", "o", "d", "dm"):
            x, y = getattr(a[k], f), getattr(b[k], f)
            assert x.dtype == y.dtype and x.shape == y.shape, (k, f)
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (k, f)
        assert a[k].fmt == b[k].fmt and a[k].zero_point == b[k].zero_point


def test_the_next_load_maps_the_tiles_the_first_one_wrote(qwen_coder_path, tmp_path):
    """The registry's Qwen2.5-Coder (Q5_0, Q8_0, Q4_K, Q6_K): the first load repacks every
    matrix and writes them; the second maps them all, same arrays, same greedy tokens as a
    load without the cache."""
    plain, none, mats = _load(qwen_coder_path, None)
    assert none is None
    first, c1, _ = _load(qwen_coder_path, tmp_path)
    assert (c1.hits, c1.misses > 0) == (0, True) and c1.path.is_file()
    second, c2, mapped = _load(qwen_coder_path, tmp_path)
    assert (c2.hits, c2.misses) == (c1.misses, 0)
    assert plain == first == second
    _same_bits(mats, mapped)
    assert all(not m.q.flags.owndata for m in mapped.values())      # views of the file


def test_an_unload_finishes_the_write(tmp_path):
    """The runner's close (an unload, before its engine process ends) writes the file even
    when the load was a moment ago."""
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    e = Engine(str(path), EngineConfig(backend="cpu", repack_cache=str(tmp_path),
                                       repack_cache_bytes=8 << 30))
    cache = e.runner.ops.packed_cache
    e.close()
    assert cache.path.is_file() and len(pc.PackedCache(tmp_path, str(path), 8 << 30)._index)


def test_a_damaged_file_is_repacked_and_written_again(tmp_path, caplog):
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    want, c1, mats = _load(path, tmp_path)
    size = c1.path.stat().st_size
    with open(c1.path, "r+b") as f:         # cut off the index and trailer
        f.truncate(size - 100)
    with caplog.at_level(logging.WARNING):
        got, c2, again = _load(path, tmp_path)
    assert "unreadable" in caplog.text
    assert c2.hits == 0 and got == want
    assert c2.path.stat().st_size == size   # written again, whole
    _same_bits(mats, again)
    with open(c2.path, "r+b") as f:         # an array that points past the data
        f.seek(size - pc.TRAILER - 40)
        f.write(b"9" * 8)
    got, c3, _ = _load(path, tmp_path)
    assert c3.hits == 0 and got == want


def test_a_partial_file_is_completed(tmp_path):
    """A load that wrote part of the matrices (a failed load): the next maps those, repacks
    the rest and writes the file whole."""
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    want, c1, mats = _load(path, tmp_path)
    n = c1.misses
    cache = pc.PackedCache(tmp_path, str(path), 8 << 30)
    for name in list(cache._index)[: n // 2]:
        cache.get(name)
    cache.put("not.a.tensor", next(iter(mats.values())))    # one repacked: a rewrite
    cache.flush()
    assert len(pc.PackedCache(tmp_path, str(path), 8 << 30)._index) == n // 2 + 1
    got, c2, again = _load(path, tmp_path)
    assert (c2.hits, c2.misses) == (n // 2, n - n // 2) and got == want
    assert c2.hits + c2.misses == n
    got, c3, _ = _load(path, tmp_path)
    assert (c3.hits, c3.misses) == (n, 0)


def test_the_least_recently_used_model_goes_first(tmp_path):
    src = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    a, b, c = (tmp_path / f"{n}.gguf" for n in "abc")
    for p in (a, b, c):                 # three models (paths) of one size
        p.write_bytes(src.read_bytes())
    root = tmp_path / "repacked"
    stale = root / "0123456789abcdef"   # another tile layout's directory
    stale.mkdir(parents=True)
    (stale / "old.tiles").write_bytes(b"x")
    _, ca, _ = _load(a, root)
    assert not stale.exists()
    size = ca.path.stat().st_size
    _, cb, _ = _load(b, root, limit=2 * size)
    _load(a, root, limit=2 * size)      # a mapped: now the most recently used
    _, cc, _ = _load(c, root, limit=2 * size)
    assert ca.path.is_file() and cc.path.is_file() and not cb.path.exists()
    _, big, _ = _load(src, root, limit=size // 2)   # bigger than the cache: not written
    assert not big.path.exists() and ca.path.is_file()


def test_the_file_of_a_removed_gguf_goes_at_the_next_eviction(tmp_path):
    src = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for p in (a, b):
        p.write_bytes(src.read_bytes())
    root = tmp_path / "repacked"
    _, ca, _ = _load(a, root)
    _, cb, _ = _load(b, root)
    a.unlink()                          # `edgeinfer rm`
    old_tmp = cb.path.with_name("x.tiles.1.tmp")      # a killed writer's, long ago
    old_tmp.write_bytes(b"x")
    os.utime(old_tmp, (1, 1))
    new_tmp = cb.path.with_name("y.tiles.2.tmp")      # a live writer's
    new_tmp.write_bytes(b"x")
    pc.evict(root, 8 << 30)
    assert not ca.path.exists() and cb.path.is_file()
    assert not old_tmp.exists() and new_tmp.exists()


def test_an_unwritable_directory_serves_from_memory(tmp_path, caplog):
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    want, _, _ = _load(path, None)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        got, c, _ = _load(path, blocker / "repacked")
    assert got == want and c.misses > 0 and not c.path.exists()
    assert "not writing" in caplog.text


def test_a_full_disk_serves_from_memory(tmp_path, monkeypatch, caplog):
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    want, _, _ = _load(path, None)

    def full(f, m):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pc, "_append", full)
    with caplog.at_level(logging.WARNING):
        got, c, _ = _load(path, tmp_path)
    assert got == want and not c.path.exists()
    assert "No space left" in caplog.text
    assert not list(c.path.parent.glob("*.tmp"))


def test_a_nearly_full_disk_is_left_alone(tmp_path, monkeypatch, caplog):
    """Less than the file plus MIN_FREE_BYTES free: nothing written, the model served."""
    path = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    want, _, _ = _load(path, None)
    real = pc.shutil.disk_usage
    monkeypatch.setattr(pc.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=pc.MIN_FREE_BYTES + 1000))
    with caplog.at_level(logging.WARNING):
        got, c, _ = _load(path, tmp_path)
    assert got == want and not c.path.exists()
    assert "free on its disk" in caplog.text


def test_a_rewritten_gguf_is_another_model(tmp_path):
    src = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    path = tmp_path / "m.gguf"
    path.write_bytes(src.read_bytes())
    before = pc.model_file(tmp_path, str(path))
    os.utime(path, ns=(1, 1))
    assert pc.model_file(tmp_path, str(path)) != before


def test_a_store_blob_is_keyed_by_its_content(tmp_path):
    """Two stores holding one blob (its file named by its sha256) share one file, kept when
    one of them goes."""
    src = synth.synthetic_model(CACHE, "llama", "Q4_K_M")
    name = "sha256-" + "ab" * 32
    a, b = tmp_path / "s1" / name, tmp_path / "s2" / name
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(src.read_bytes())
    root = tmp_path / "repacked"
    assert pc.model_file(root, str(a)) == pc.model_file(root, str(b))
    _, ca, _ = _load(a, root)
    _, cb, _ = _load(b, root)
    assert cb.hits == ca.misses and cb.misses == 0
    a.unlink()
    pc.evict(root, 8 << 30)
    assert cb.path.is_file()


def test_settings():
    assert Settings.from_env({"EDGEINFER_REPACK_CACHE": "0"}).repack_cache is None
    s = Settings.from_env({"EDGEINFER_REPACK_CACHE": "/x/y", "EDGEINFER_REPACK_CACHE_GB": "2"})
    assert (s.repack_cache, s.repack_cache_bytes) == ("/x/y", 2 << 30)
    d = Settings.from_env({})
    assert d.repack_cache.endswith("repacked") and d.repack_cache_bytes == 8 << 30
    assert EngineConfig.from_settings(s).repack_cache == "/x/y"
    assert EngineConfig().repack_cache is None           # scripts and tests: off
