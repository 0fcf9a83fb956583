"""Untied embedding tables are read from the model file by rows (backends/cpu/ops.FileTable)
instead of being repacked: the rows must be the very bits the mapped blocks decode to, and the
table must stay out of the process's memory however many tokens a prompt touches."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.cpu.ops import CpuOps, FileTable
from edgeinfer.backends.cpu.quants import QuantMatrix, get_rows
from edgeinfer.formats.gguf_file import read_gguf


def _resident_mb(gf, name: str) -> float:
    """MB of the tensor's pages mapped into this process (from /proc/self/pagemap)."""
    t = gf.tensors[name]
    page = 4096
    view = np.frombuffer(gf._mmap, np.uint8)
    first = (view.ctypes.data + t.offset) // page
    n = t.nbytes // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(n * 8), np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page / 2**20


def test_file_table_rows_are_the_mapped_rows(qwen_coder_path):
    gf = read_gguf(qwen_coder_path)
    table = CpuOps().table(gf, "token_embd.weight")
    assert isinstance(table, FileTable) and table.N == 151936 and table.K == 896
    mapped = QuantMatrix.from_gguf(gf, "token_embd.weight")
    ids = np.random.default_rng(3).integers(0, table.N, 700)
    ids[::7] = ids[0]                              # repeated tokens, as prompts have
    ids = np.concatenate([ids, [0, table.N - 1]])
    np.testing.assert_array_equal(table.rows(ids), get_rows(mapped, ids))
    assert table.rows(np.array([5], np.int64)).shape == (1, 896)
    # one row (a decode step: decoded on the calling thread) is that row of the big lookup
    for i in (0, 7, 701, 7):
        np.testing.assert_array_equal(table.rows(ids[i:i + 1]), get_rows(mapped, ids)[i:i + 1])
    # a recent row comes back as a copy: writing one (the model's residual) changes no other
    a = table.rows(ids[:1])
    a += 1.0
    np.testing.assert_array_equal(table.rows(ids[:1]), get_rows(mapped, ids[:1]))
    with pytest.raises(IndexError):
        table.rows(np.array([table.N]))
    with pytest.raises(IndexError):
        table.rows(np.array([-1]))


def test_file_table_maps_no_pages(qwen_coder_path):
    gf = read_gguf(qwen_coder_path)
    gf.release_pages()
    table = CpuOps().table(gf, "token_embd.weight")
    table.rows(np.random.default_rng(4).integers(0, table.N, 4096))
    assert _resident_mb(gf, "token_embd.weight") < 1.0
    # the measure sees pages: the same lookup through the map makes 4096 random rows of
    # 616 bytes resident, at least a page each (here fault-around maps most of the 89 MB)
    get_rows(QuantMatrix.from_gguf(gf, "token_embd.weight"),
             np.random.default_rng(4).integers(0, table.N, 4096))
    assert _resident_mb(gf, "token_embd.weight") > 8
