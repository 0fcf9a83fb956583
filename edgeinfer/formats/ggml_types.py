"""ggml's tensor type codes, block sizes and file types: the GGUF format's own numbers.

The `gguf` package has these too, but importing it loads its writer, vocabulary, metadata
and YAML modules and every architecture's tensor names: 25-35 ms of every cold start, for
three tables. The reader, the backends and the store use these; `gguf` stays for writing
files (formats/synthetic.py) and for its reference dequantizer. The members are IntEnums
with ggml's values, so they compare, hash and index like the `gguf` package's own
(tests/test_ggml_types.py checks every value and size against it).
"""
from __future__ import annotations

from enum import IntEnum

QK_K = 256      # the k-quants' super-block


class GGMLQuantizationType(IntEnum):
    """ggml_type in ggml.h."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_Q = GGMLQuantizationType

# type -> (values per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _Q.F32: (1, 4),
    _Q.F16: (1, 2),
    _Q.Q4_0: (32, 2 + 16),
    _Q.Q4_1: (32, 2 + 2 + 16),
    _Q.Q5_0: (32, 2 + 4 + 16),
    _Q.Q5_1: (32, 2 + 2 + 4 + 16),
    _Q.Q8_0: (32, 2 + 32),
    _Q.Q8_1: (32, 4 + 4 + 32),
    _Q.Q2_K: (256, 2 + 2 + QK_K // 16 + QK_K // 4),
    _Q.Q3_K: (256, 2 + QK_K // 4 + QK_K // 8 + 12),
    _Q.Q4_K: (256, 2 + 2 + QK_K // 2 + 12),
    _Q.Q5_K: (256, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    _Q.Q6_K: (256, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    _Q.Q8_K: (256, 4 + QK_K + QK_K // 8),
    _Q.IQ2_XXS: (256, 2 + QK_K // 4),
    _Q.IQ2_XS: (256, 2 + QK_K // 4 + QK_K // 32),
    _Q.IQ3_XXS: (256, 2 + QK_K // 4 + QK_K // 8),
    _Q.IQ1_S: (256, 2 + QK_K // 8 + QK_K // 16),
    _Q.IQ4_NL: (32, 2 + 16),
    _Q.IQ3_S: (256, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    _Q.IQ2_S: (256, 2 + QK_K // 4 + QK_K // 16),
    _Q.IQ4_XS: (256, 2 + 2 + QK_K // 2 + QK_K // 64),
    _Q.I8: (1, 1),
    _Q.I16: (1, 2),
    _Q.I32: (1, 4),
    _Q.I64: (1, 8),
    _Q.F64: (1, 8),
    _Q.IQ1_M: (256, QK_K // 8 + QK_K // 16 + QK_K // 32),
    _Q.BF16: (1, 2),
    _Q.TQ1_0: (256, 2 + 4 * 13),
    _Q.TQ2_0: (256, 2 + 64),
    _Q.MXFP4: (32, 1 + 16),
    _Q.NVFP4: (64, 4 + 32),
    _Q.Q1_0: (128, 2 + 16),
}


class LlamaFileType(IntEnum):
    """llama_ftype in llama.h: a file's general.file_type (the type of most 2-D tensors)."""
    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_Q2_K_S = 21
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_MXFP4_MOE = 38
    MOSTLY_NVFP4 = 39
    MOSTLY_Q1_0 = 40
    GUESSED = 1024


def dequantize(data, qtype):
    """float32 values of a raw tensor: the `gguf` package's reference dequantizer, imported
    only when a caller needs it (a 1-D tensor stored quantized; the torch backend's load)."""
    from gguf.quants import dequantize as ref   # lazy: the gguf package's import, see above
    return ref(data, qtype)
