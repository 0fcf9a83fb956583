"""What the numba CPU backend would do with a model file, known without importing it.

The daemon answers /api/show's `runtime` (the weights format a load would use) for models
it has not loaded, and `edgeinfer run` asks /api/show before its first request: importing
backends/cpu for that (numba's runtime and ~40 kernel modules) cost the first /api/show
~0.4 s and the daemon ~65 MB for good. This module holds what that answer needs and nothing
that compiles: the repacked layout's sizes (repack.py builds that layout and imports them
from here), the host's tile kernel, and the rule for whether a load repacks
(CpuOps.would_repack applies it).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from edgeinfer.formats.ggml_types import GGMLQuantizationType as Q

LANES = 16          # rows per repacked tile (the tile kernels, backends/cpu/_int8.py, use it)
MXFP4 = int(Q.MXFP4)

# activation format (ggml's vec_dot_type) per weight type: block size of its scale
ACT_BLOCK = {**{int(t): 32 for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)},
             **{int(t): 256 for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)}}
REPACKABLE = frozenset(ACT_BLOCK)
# columns per repacked scale, and the formats whose blocks carry an offset (a minimum)
COLS = {int(t): (16 if t in (Q.Q2_K, Q.Q3_K, Q.Q6_K) else 32) for t in map(Q, REPACKABLE)}
WITH_OFFSET = frozenset(int(t) for t in (Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K))
# code bits kept per format; the legacy formats' scales stay halves, the k-quants' are a half
# per super-block times an int8 per block (see _int8.py)
BITS = {**{int(t): 4 for t in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q2_K, Q.Q3_K)},
        **{int(t): 5 for t in (Q.Q5_0, Q.Q5_1, Q.Q5_K)},
        int(Q.Q6_K): 6, int(Q.Q8_0): 8}
SUB = frozenset(int(t) for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))


def packed_nbytes(qtype, K: int, N: int) -> int:
    """Bytes a K x N matrix of this type takes repacked (codes, scales, offsets, padded rows)."""
    code = int(qtype)
    scales = 2 if code in WITH_OFFSET else 1
    per_row = K * BITS[code] // 8
    if code in SUB:
        per_row += scales * (K // COLS[code] + 2 * (K // 256))
    else:
        per_row += scales * 2 * (K // COLS[code])
    return -(-N // LANES) * LANES * per_row


def repacked_tensor(gguf_file, name: str) -> bool:
    """Whether a repacking load repacks this tensor: a repackable matrix other than an
    embedding table that the output head does not share (models load it with `table`)."""
    t = gguf_file.tensors[name]
    # 3-D: a mixture-of-experts tensor, one matrix per expert (models/qwen3moe.py)
    if len(t.shape) not in (2, 3) or int(t.ggml_type) not in REPACKABLE:
        return False
    return not (name == "token_embd.weight" and "output.weight" in gguf_file.tensors)


def packed_size(t) -> int:
    rows = int(t.shape[1]) * (int(t.shape[2]) if len(t.shape) == 3 else 1)
    return packed_nbytes(t.ggml_type, int(t.shape[0]), rows)


def repacked_bytes(gguf_file) -> int:
    """Memory the integer-dot layout would take for this file's repackable matrices."""
    return sum(packed_size(t) for name, t in gguf_file.tensors.items()
               if repacked_tensor(gguf_file, name))


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


# -- the host's tile kernel ---------------------------------------------------------------
# Tile kernels by instruction set (_int8.py imports these): AVX-512 VNNI, AVX-VNNI, AVX2, or
# the portable numba loop; the features each needs, as LLVM names them (_int8 asks LLVM for
# the host's)
PORTABLE, AVX2, AVXVNNI, AVX512VNNI = 0, 1, 2, 3
NEEDS = {AVX2: ("avx2", "f16c"), AVXVNNI: ("avx2", "f16c", "avxvnni"),
         AVX512VNNI: ("avx512f", "avx512bw", "avx512vnni", "f16c")}
ISA_LABELS = {AVX512VNNI: "AVX-512 VNNI", AVXVNNI: "AVX-VNNI", AVX2: "AVX2"}
# Linux's /proc/cpuinfo names for them, where they differ
_CPUINFO = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}


def best_isa(features: dict | None = None) -> int:
    """The best tile kernel for these features (LLVM's names; None: this host's)."""
    f = host_features() if features is None else features
    return max([PORTABLE] + [i for i, need in NEEDS.items() if all(f.get(n) for n in need)])


def host_features() -> dict:
    """The host's CPU features by LLVM's names: from /proc/cpuinfo on Linux (llvmlite's
    query loads LLVM, ~40 MB), else from llvmlite; {} where neither answers."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        return {n: _CPUINFO.get(n, n) in flags
                                for need in NEEDS.values() for n in need}
        except OSError:
            pass
    try:
        import llvmlite.binding as llb
        return dict(llb.get_host_cpu_features())
    except Exception:          # noqa: BLE001 - no feature query on this platform
        return {}


# -- what a load does ---------------------------------------------------------------------
MXFP4_NOTE = "; MXFP4 read in place from the file"


@dataclass(frozen=True)
class FileLayout:
    """What the repack decision and the weights format read from a file's tensor table (a
    reader of the file's other facts keeps it: /api/show parses once)."""
    repacked_bytes: int
    mxfp4: bool

    @classmethod
    def of(cls, gguf_file) -> "FileLayout":
        return cls(repacked_bytes(gguf_file),
                   any(int(t.ggml_type) == MXFP4 for t in gguf_file.tensors.values()))


def weights_format(repacked: bool, isa: int) -> str:
    if repacked:
        return (f"int8 tiles repacked from GGUF blocks "
                f"({ISA_LABELS.get(isa, 'portable')} integer dot)")
    return "gguf (quantized blocks, decoded per matmul)"


def repacks(layout: FileLayout, repack: bool | None, numerics: str, isa: int) -> bool:
    """Whether a load repacks the weights: `repack` (Settings.repack) when set, else with
    ggml numerics on a CPU with a vector tile kernel when the repacked weights take at most
    half of the RAM (benchmarks/isa_ab.py measured even the AVX2 tiles at 2.11x prefill and
    1.32x decode of the GGUF-block path)."""
    if repack is not None:
        return repack
    return numerics == "ggml" and isa > PORTABLE and layout.repacked_bytes <= ram_bytes() // 2


def would_repack(gguf_file, repack: bool | None, numerics: str, isa: int) -> bool:
    """repacks() for a parsed file (the engine's load: CpuOps.would_repack)."""
    if repack is not None:
        return repack
    return repacks(FileLayout.of(gguf_file), repack, numerics, isa)


def layout_weights_format(layout: FileLayout, repack: bool | None = None,
                          numerics: str = "ggml", isa: int | None = None) -> str:
    """The weights_format a model of this layout would report (isa None: this host's)."""
    isa = best_isa() if isa is None else isa
    return weights_format(repacks(layout, repack, numerics, isa), isa) + \
        (MXFP4_NOTE if layout.mxfp4 else "")


def weights_format_for(gguf_file, repack: bool | None = None, numerics: str = "ggml",
                       isa: int | None = None) -> str:
    return layout_weights_format(FileLayout.of(gguf_file), repack, numerics, isa)
