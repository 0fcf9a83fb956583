"""The GGUF loader: a valid file parses; truncated, empty, random or hostile files give one
clear sentence (never a traceback, never a huge allocation)."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from edgeinfer.formats.gguf_file import GGUFError, read_gguf
from edgeinfer.formats.model_config import UnsupportedArchitecture, load_model_config, summarize

HEADER = 4 + 4 + 8 + 8


@pytest.fixture(scope="module")
def head_bytes(gemma3_path) -> bytes:
    """The real file's header (metadata + tensor table), where the parser's risk lives."""
    f = read_gguf(gemma3_path)
    n = f.data_offset
    f.close()
    with open(gemma3_path, "rb") as fh:
        return fh.read(n)


def test_real_model_config(gemma3_path):
    f = read_gguf(gemma3_path)
    cfg = load_model_config(f)
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512 and cfg.tied_output
    assert [cfg.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert cfg.kv_bytes_per_token(2) == 2 * 18 * 1 * 256 * 2
    s = summarize(f)
    assert s.file_type == "Q4_K_M"
    assert s.quant_counts == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert s.n_params == sum(t.n_elements for t in f.tensors.values())
    # Tensor data is a view into the map, not a copy.
    raw = f.raw("output_norm.weight")
    assert raw.nbytes == 640 * 4 and not raw.flags.owndata


def _write(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("data, message", [
    (b"", "too small"),
    (b"GGUF", "too small"),
    (b"NOPE" + bytes(40), "not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0), "claims 4611686018427387904 tensors"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62), "metadata entries"),
    # a key whose length runs past the end
    (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**40) + b"k" + bytes(64), "plausible"),
    # an array of 2^62 uint32 items
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 4, 2**62) + bytes(64),
     "more than the file can hold"),
    # unknown value type
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", 99) + bytes(64),
     "unknown value type"),
])
def test_hostile_headers(tmp_path, data, message):
    with pytest.raises(GGUFError, match=message):
        read_gguf(_write(tmp_path, data))


def _tensor_table(name: bytes, dims: list[int], ttype: int, offset: int) -> bytes:
    out = struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    return out + struct.pack("<IQ", ttype, offset)


@pytest.mark.parametrize("dims, ttype, offset, message", [
    ([4, 4], 0, 2**60, "extends past the end"),        # offset beyond the file (Bleeding Llama)
    ([2**40, 2**40], 0, 0, "extends past the end"),     # 2^80 elements: no int64 wrap-around
    ([2**41], 0, 0, "invalid shape"),
    ([4, 4, 4, 4, 4], 0, 0, "5 dimensions"),
    ([4], 12345, 0, "unknown type id"),
    ([10], 8, 0, "not a multiple"),                     # Q8_0 row not a multiple of 32
    ([4], 0, 3, "not aligned"),
    ([0], 0, 0, "invalid shape"),
])
def test_hostile_tensor_table(tmp_path, dims, ttype, offset, message):
    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + _tensor_table(b"t", dims, ttype, offset)
    data += bytes(-len(data) % 32) + bytes(64)
    with pytest.raises(GGUFError, match=message):
        read_gguf(_write(tmp_path, data))


def test_overlapping_tensors(tmp_path):
    data = b"GGUF" + struct.pack("<IQQ", 3, 2, 0)
    data += _tensor_table(b"a", [16], 0, 0) + _tensor_table(b"b", [16], 0, 32)
    data += bytes(-len(data) % 32) + bytes(128)
    with pytest.raises(GGUFError, match="overlap"):
        read_gguf(_write(tmp_path, data))


def test_truncated_real_file(tmp_path, gemma3_path, head_bytes):
    for cut in (30, 1000, 100_000, len(head_bytes) - 3, len(head_bytes) + 1000):
        with open(gemma3_path, "rb") as fh:
            data = fh.read(cut)
        with pytest.raises(GGUFError):
            read_gguf(_write(tmp_path, data))


def test_missing_tensor_and_bad_shape(tmp_path, head_bytes, gemma3_path):
    # Rename one required tensor in place (same length) and check the config refuses it.
    data = bytearray(open(gemma3_path, "rb").read())
    i = data.find(b"blk.3.ffn_up.weight")
    data[i:i + 19] = b"blk.3.ffn_XX.weight"
    p = _write(tmp_path, bytes(data))
    with pytest.raises(GGUFError, match="missing tensor 'blk.3.ffn_up.weight'"):
        load_model_config(read_gguf(p))


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(p), "phi2")
    w.add_tensor("x", np.zeros(32, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedArchitecture, match="'phi2'.*--backend llamacpp"):
        load_model_config(read_gguf(p))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_header(tmp_path, head_bytes, data):
    """Random byte edits, insertions and truncations of the real header: GGUFError or success,
    nothing else (no IndexError, MemoryError, struct.error, OverflowError...)."""
    buf = bytearray(head_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "u64", "cut", "insert"]))
        pos = data.draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "u64" and pos + 8 <= len(buf):
            buf[pos:pos + 8] = struct.pack("<Q", data.draw(st.sampled_from(
                [0, 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1, len(buf)])))
        elif op == "cut":
            del buf[pos:]
            if not buf:
                break
        else:
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        f = read_gguf(_write(tmp_path, bytes(buf)))
    except GGUFError as e:
        assert str(e) and "\n" not in str(e)
        return
    # If it parsed, every tensor lies inside the file.
    for t in f.tensors.values():
        assert t.offset + t.nbytes <= f.file_size


def test_cli_show_bad_files_no_traceback(tmp_path):
    for name, data in [("empty.gguf", b""), ("rand.gguf", np.random.default_rng(0).bytes(5000)),
                       ("hostile.gguf", b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62))]:
        p = tmp_path / name
        p.write_bytes(data)
        r = subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", "show", str(p)],
                           capture_output=True, text=True)
        assert r.returncode == 1, r
        assert "Traceback" not in r.stderr and str(p) in r.stderr
        assert len(r.stderr.strip().splitlines()) <= 2
    r = subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", "show", str(tmp_path / "nope.gguf")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "not found" in r.stderr


def test_cli_show_real_model(gemma3_path):
    r = subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", "show", str(gemma3_path)],
                       capture_output=True, text=True, check=True)
    for needle in ("gemma3", "Q4_K_M", "32768", "18", "4 / 1", "256", "262,144", "llama tokenizer",
                   "253,113,024"):
        assert needle in r.stdout, needle
    # the KV row is the pool of the backend auto picks, at its own element size
    from edgeinfer.runners.choice import estimate_memory, resolve
    backend = resolve("auto", None, "gemma3")
    per_value = estimate_memory(backend, str(gemma3_path)).kv_bytes_per_value
    per_token = 2 * 18 * 1 * 256 * per_value
    kv = next(line for line in r.stdout.splitlines() if "KV cache" in line)
    assert f"{per_token:,} bytes/token (" in kv and f"on {backend})" in kv
    assert f"x {per_value} bytes" in kv
    # Gemma 3's sliding-window layers keep only their window (the KV planner's window group)
    if backend == "cpu":
        assert "15 of 18 layers see only the last 512 tokens" in kv and "3,072 bytes/token" in kv


def test_released_pages_read_back_the_same_bytes(gemma3_path):
    gf = read_gguf(gemma3_path)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"]
    before = {n: gf.raw(n).copy() for n in names}
    view = gf.raw("blk.0.attn_q.weight")          # a view held across the release
    gf.release_pages("token_embd.weight")
    gf.release_pages("output_norm.weight")        # smaller than a page: nothing to drop
    gf.release_pages()
    for n in names:
        np.testing.assert_array_equal(gf.raw(n), before[n])
    np.testing.assert_array_equal(view, before["blk.0.attn_q.weight"])


def _string_array(strings: list[bytes], claimed: int | None = None) -> bytes:
    """A GGUF with one metadata key: an array of strings (count `claimed` if given)."""
    body = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"v"
    return head + struct.pack("<IIQ", 9, 8, len(strings) if claimed is None else claimed) + body


def test_long_string_arrays_walk_compiled_with_the_same_strings_and_errors(tmp_path):
    """Arrays of 4096 strings and more can follow their lengths in numba (_string_heads, the
    model runner's way): the same strings as the Python loop (invalid UTF-8 and an embedded NUL included), and the
    same errors for a truncated array or an implausible length."""
    from edgeinfer.formats import gguf_file
    rng = np.random.default_rng(0)
    strings = [bytes(rng.integers(32, 127, int(rng.integers(0, 12)), dtype=np.uint8))
               for _ in range(5000)]
    strings[7], strings[4000] = b"\xff\xfe bad utf-8", "é—ok".encode()
    want = [s.decode("utf-8", errors="surrogateescape") for s in strings]
    p = _write(tmp_path, _string_array(strings))
    assert read_gguf(p, compiled_walk=True).metadata["v"] == want == read_gguf(p).metadata["v"]
    with_nul = list(strings)
    with_nul[9] = b"a\x00b"             # the string-by-string way
    p = _write(tmp_path, _string_array(with_nul))
    assert read_gguf(p, compiled_walk=True).metadata["v"][9] == "a\x00b"
    for data, message in [(_string_array(strings)[:-3], "runs past the end"),
                          (_string_array(strings, claimed=5001) + bytes(4), "runs past the end"),
                          (_string_array(strings[:4999], claimed=5000)
                           + struct.pack("<Q", 2**40) + bytes(16), "plausible")]:
        with pytest.raises(GGUFError, match=message):
            read_gguf(_write(tmp_path, data), compiled_walk=True)
    assert len(strings) >= gguf_file._COMPILED_WALK


def test_remembered_headers_parse_once_and_see_a_rewritten_file(tmp_path, monkeypatch):
    """remember_headers() (the engine process's): a second read of the same file gets the
    first read's parse with a mapping of its own; a file rewritten in place is parsed again."""
    from synth import write_model

    from edgeinfer.formats import gguf_file
    monkeypatch.setattr(gguf_file, "_HEADERS", None)
    gguf_file.remember_headers()
    path = write_model(tmp_path / "m.gguf", "llama", chat_template="{{ 1 }}")
    a = read_gguf(path)
    b = read_gguf(path)
    assert b.metadata is a.metadata and b.tensors is a.tensors
    name = next(iter(a.tensors))
    a.close()                                   # b's mapping is its own
    assert np.array_equal(b.raw(name), np.frombuffer(path.read_bytes(), np.uint8,
                                                      count=b.tensors[name].nbytes,
                                                      offset=b.tensors[name].offset))
    write_model(tmp_path / "m.gguf", "qwen2")           # rewritten: another header
    c = read_gguf(path)
    assert c.metadata is not a.metadata
    assert c.metadata["general.architecture"] == "qwen2"
    assert "tokenizer.chat_template" not in c.metadata


def test_a_parse_handed_on_serves_the_next_read_once_and_expires(tmp_path, monkeypatch):
    """read_gguf(hand_on_s=...) (the daemon's /api/show): the next read of the same file in
    that time takes the parse (the load right after reads no vocabulary again), with a mapping
    of its own; the read after that parses; a rewritten file or a late read parses again."""
    import time

    from synth import write_model

    from edgeinfer.formats import gguf_file
    monkeypatch.setattr(gguf_file, "_HEADERS", None)
    monkeypatch.setattr(gguf_file, "_HANDOFF", None)
    parses = []
    real_parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda *a: parses.append(a[0]) or real_parse(*a))
    path = write_model(tmp_path / "m.gguf", "llama", chat_template="{{ 1 }}")
    shown = read_gguf(path, hand_on_s=30)
    shown.close()
    loaded = read_gguf(path)
    assert len(parses) == 1 and loaded.metadata is shown.metadata
    name = next(iter(loaded.tensors))
    assert np.array_equal(loaded.raw(name), np.frombuffer(
        path.read_bytes(), np.uint8, count=loaded.tensors[name].nbytes,
        offset=loaded.tensors[name].offset))
    read_gguf(path).close()                     # taken once: this one parses
    assert len(parses) == 2
    read_gguf(path, hand_on_s=30).close()
    write_model(tmp_path / "m.gguf", "qwen2")   # rewritten: the handed parse is not its own
    assert read_gguf(path).metadata["general.architecture"] == "qwen2"
    assert len(parses) == 4
    read_gguf(path, hand_on_s=0.05).close()
    time.sleep(0.3)                             # expired: the vocabulary went back
    assert gguf_file._HANDOFF is None
    read_gguf(path).close()
    assert len(parses) == 6


def test_will_need_asks_for_every_tensor_and_changes_no_byte(tmp_path):
    """GGUFFile.will_need (a load's read-ahead of the small tensors it copies): a range per
    tensor, page-aligned, inside the mapping; the bytes read after are the file's."""
    import mmap as _mmap

    from synth import write_model
    path = write_model(tmp_path / "m.gguf", "llama")
    gf = read_gguf(path)
    calls = []

    class Recording:
        def __init__(self, mm):
            self.mm = mm

        def __len__(self):
            return len(self.mm)

        def madvise(self, flag, start, length):
            calls.append((flag, start, length))
            return self.mm.madvise(flag, start, length)
    real = gf._mmap
    gf._mmap = Recording(real)
    names = list(gf.tensors)
    gf.will_need(names)
    gf._mmap = real
    assert len(calls) == len(names)
    for (flag, start, length), name in zip(calls, names):
        t = gf.tensors[name]
        assert flag == _mmap.MADV_WILLNEED and start % _mmap.PAGESIZE == 0
        assert start <= t.offset and t.offset + t.nbytes <= start + length <= len(real)
    blob = path.read_bytes()
    for name in names:
        t = gf.tensors[name]
        assert gf.raw(name).tobytes() == blob[t.offset:t.offset + t.nbytes]
    gf.close()
