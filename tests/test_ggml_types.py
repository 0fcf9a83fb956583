"""edgeinfer.formats.ggml_types against the gguf package: the same numbers, and the same
behaviour where the two meet (dict keys, comparisons, the reference dequantizer)."""
import subprocess
import sys

import gguf
import numpy as np

from edgeinfer.formats import ggml_types as ours


def test_quant_types_match_gguf():
    for t in ours.GGMLQuantizationType:
        assert gguf.GGMLQuantizationType[t.name] == t.value
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.value)] == \
            ours.GGML_QUANT_SIZES[t], t.name
    assert set(ours.GGML_QUANT_SIZES) == set(ours.GGMLQuantizationType)


def test_file_types_match_gguf():
    for t in ours.LlamaFileType:
        assert gguf.LlamaFileType[t.name] == t.value


def test_interchangeable_with_gguf_members():
    q = ours.GGMLQuantizationType.Q4_K
    assert q == gguf.GGMLQuantizationType.Q4_K
    assert gguf.GGML_QUANT_SIZES[q] == ours.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    raw = np.arange(34, dtype=np.uint8)      # one Q8_0 block
    np.testing.assert_array_equal(ours.dequantize(raw, ours.GGMLQuantizationType.Q8_0),
                                  gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))


def test_the_load_path_does_not_import_gguf():
    """The reader, the CPU backend and the engine: no `gguf` package (25-35 ms of a start)."""
    code = ("import sys, edgeinfer.formats.gguf_file, backends.cpu.ops, edgeinfer.engine.core, "
            "edgeinfer.store.model_store; print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
