"""numba's disk cache, loaded without parsing each kernel's LLVM bitcode.

A kernel numba loads from its cache comes as two blobs: the machine code (an object file the
JIT links) and the optimized module's full bitcode, kept only so that a later compilation
can link the kernel in and inline it. numba parses that bitcode on every load, to list the
symbols the object defines: for our fused kernels, whose helpers are all inlined, ~20 of a
load's ~27 ms (LLVMPY_ParseBitcode), and a first token loads about a dozen of them.

`install()` makes the load read the defined symbols from the object file's ELF symbol table
instead (no LLVM call) and parse the bitcode only when something links against the kernel.
The machine code, and so every result, is the one numba cached. It patches two methods of
numba's CPUCodeLibrary, and only on numba versions whose code it was written against
(KNOWN); elsewhere, and for any object file that is not 64-bit little-endian ELF (macOS,
Windows), loads go through numba's own path.

It never imports numba: `edgeinfer/__init__` calls install() in every process, and it waits
for numba's codegen module to be imported (the daemon never imports it).
"""
from __future__ import annotations

import struct
import sys

KNOWN = ("0.68.",)      # numba versions whose CPUCodeLibrary this patches (see _patch)

_SYMBOL = [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
           ("value", "<u8"), ("size", "<u8")]
_SHT_SYMTAB, _STT_SECTION, _STT_FILE = 2, 3, 4


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """The names an ELF64 little-endian relocatable object defines (functions and data; not
    sections or file names); None if `obj` is not one."""
    import numpy as np      # lazy: with numba, which imports it anyway
    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize)
                for i in range(shnum)]
    names: set[str] = set()
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_SYMTAB:
            continue
        sym = np.frombuffer(obj, np.dtype(_SYMBOL), size // 24, offset)
        kind_of = sym["info"] & 0xF
        defined = ((sym["shndx"] != 0) & (kind_of != _STT_SECTION) & (kind_of != _STT_FILE)
                   & (sym["name"] != 0))
        strtab = sections[link]
        strings = obj[strtab[4]:strtab[4] + strtab[5]]
        for start in sym["name"][defined].tolist():
            names.add(strings[start:strings.index(b"\0", start)].decode())
    return names


def _patch(codegen) -> bool:
    """Patch numba.core.codegen's CPUCodeLibrary (see the module's docstring)."""
    import numba
    lib = codegen.CPUCodeLibrary
    if not numba.__version__.startswith(KNOWN) or getattr(lib, "_edgeinfer_lazy", False):
        return False
    own_unserialize = lib._unserialize.__func__
    own_linking = lib._get_module_for_linking
    ll = codegen.ll

    def _unserialize(cls, cg, state):
        name, kind, data = state
        names = elf_defined_symbols(data[0]) if kind == "object" else None
        if names is None:
            return own_unserialize(cls, cg, state)
        self = cg.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(data[0])
        self._lazy_bitcode = data[1]         # parsed by _get_module_for_linking, if asked
        self._finalize_final_module()
        # what numba's _load_defined_symbols reads from the parsed module: the engine looks
        # up only symbols it knows are defined (an unknown one ends the process)
        self._codegen._engine._defined_symbols |= names
        return self

    def _get_module_for_linking(self):
        bitcode = self.__dict__.pop("_lazy_bitcode", None)
        if bitcode is not None:
            self._shared_module = ll.parse_bitcode(bitcode)
        return own_linking(self)

    lib._unserialize = classmethod(_unserialize)
    lib._get_module_for_linking = _get_module_for_linking
    lib._edgeinfer_lazy = True
    return True


def active() -> bool:
    """Whether loads in this process take the patched path (numba imported, version known)."""
    codegen = sys.modules.get("numba.core.codegen")
    return codegen is not None and getattr(codegen.CPUCodeLibrary, "_edgeinfer_lazy", False)


class _AfterCodegen:
    """A sys.meta_path finder that patches numba.core.codegen as soon as it is imported,
    then leaves sys.meta_path."""

    NAME = "numba.core.codegen"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        import importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch now if numba's codegen is loaded, else when it is."""
    codegen = sys.modules.get(_AfterCodegen.NAME)
    if codegen is not None:
        _patch(codegen)
    elif not any(isinstance(f, _AfterCodegen) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterCodegen())
