"""numba's disk cache, loaded without parsing each kernel's LLVM bitcode.

A kernel numba loads from its cache comes as two blobs: the machine code (an object file the
JIT links) and the optimized module's full bitcode, kept only so that a later compilation
can link the kernel in and inline it. numba parses that bitcode on every load, to list the
symbols the object defines: for our fused kernels, whose helpers are all inlined, ~20 of a
load's ~27 ms (LLVMPY_ParseBitcode), and a first token loads about a dozen of them.

`patch_codegen` makes the load read the defined symbols from the object file's ELF symbol table
instead (no LLVM call) and parse the bitcode only when something links against the kernel.
The machine code, and so every result, is the one numba cached. It patches two methods of
numba's CPUCodeLibrary, and only on numba versions whose code it was written against
(KNOWN); elsewhere, and for any object file that is not 64-bit little-endian ELF (macOS,
Windows), loads go through numba's own path.

The same for numba's runtime module (NRT), which numba compiles from IR in every process
(~17 ms): its object code is kept beside numba's cache and loaded as a kernel is
(patch_nrt).

And a cache load no longer refreshes numba's contexts first (patch_cache_load): that
refresh imports and installs every typing and lowering registry (~60-90 ms, and numba's
array-math module with it), which only a compilation reads. A load needs the runtime
initialized, which it still does; a miss refreshes before numba compiles, as before.

A loaded kernel's environment no longer imports the numba module that defined it
(patch_env_rebuild): unpickling an environment imported its module for the module's globals,
which only object-mode code reads; for numba.np.arrayobj and numba.np.npyimpl, whose
functions our kernels inline, that was ~30 ms of a first step's imports.

It never imports numba: edgeinfer/numba_hooks.py applies the patches as numba's modules
load (the daemon never imports them).
"""
from __future__ import annotations

import struct
import sys

KNOWN = ("0.68.",)      # numba versions whose CPUCodeLibrary this patches (see patch_codegen)

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


def _known() -> bool:
    """The installed numba is one whose internals these patches were written against."""
    import numba
    return numba.__version__.startswith(KNOWN)


def patch_codegen(codegen) -> bool:
    """Patch numba.core.codegen's CPUCodeLibrary (see the module's docstring)."""
    lib = codegen.CPUCodeLibrary
    if not _known() or getattr(lib, "_edgeinfer_lazy", False):
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


def _nrt_path(ctx):
    """Where the NRT module's object code for this numba, llvmlite and CPU is kept."""
    import hashlib
    import os

    import llvmlite
    import numba
    from numba.core import config
    root = config.CACHE_DIR         # NUMBA_CACHE_DIR, as numba read it (edgeinfer sets it)
    if not root:
        return None
    key = repr((numba.__version__, llvmlite.__version__, ctx.codegen().magic_tuple()))
    return os.path.join(root, "edgeinfer-nrt", hashlib.sha256(key.encode()).hexdigest()[:24])


nrt_from_cache: bool | None = None    # this process's NRT module: loaded (True) or compiled


def patch_nrt(nrtdynmod) -> bool:
    """numba compiles its runtime's LLVM module (NRT: atomic reference counts, MemInfo
    helpers) from IR in every process that runs a kernel (~17 ms, before the first one):
    keep its object code beside numba's cache, keyed by numba's and llvmlite's versions and
    the CPU (codegen.magic_tuple), and load it as numba loads a cached kernel."""
    if not _known() or getattr(nrtdynmod, "_edgeinfer_cached", False):
        return False
    import os
    import pickle

    def compile_nrt_functions(ctx):
        global nrt_from_cache
        path = _nrt_path(ctx)
        if path is not None and os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    library = ctx.codegen().unserialize_library(pickle.load(f))
                nrt_from_cache = True
                return library
            except Exception:       # noqa: BLE001 - unreadable: compile it, write it again
                pass
        nrt_from_cache = False
        ir_mod, library = nrtdynmod.create_nrt_module(ctx)
        library.add_ir_module(ir_mod)
        library.enable_object_caching()
        library.finalize()
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    pickle.dump(library.serialize_using_object_code(), f)
                os.replace(tmp, path)
            except (OSError, ValueError, pickle.PicklingError):
                pass                # a read-only cache: compiled each time, as numba does
        return library

    nrtdynmod.compile_nrt_functions = compile_nrt_functions
    nrtdynmod._edgeinfer_cached = True
    return True


def active() -> bool:
    """Whether loads in this process take the patched path (numba imported, version known)."""
    codegen = sys.modules.get("numba.core.codegen")
    return codegen is not None and getattr(codegen.CPUCodeLibrary, "_edgeinfer_lazy", False)


def patch_cache_load(caching) -> bool:
    """numba.core.caching.Cache.load_overload without the context refresh on a hit (see the
    module's docstring): numba's own calls `target_context.refresh()` before every load, and
    the first one in a process installs all of numba's registries. A loaded kernel is
    machine code that calls the runtime (NRT) and nothing registered in Python; a
    compilation refreshes the contexts itself (numba.core.compiler) and so does a function
    lookup that misses (BaseContext.get_function), and a miss here refreshes before
    returning, so a compile that follows starts where it did before."""
    cls = caching.Cache
    if not _known() or getattr(cls.load_overload, "_edgeinfer", False):
        return False
    from numba.core.runtime import rtsys

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)        # what a loaded kernel needs of the refresh
        with self._guard_against_spurious_io_errors():
            cres = self._load_overload(sig, target_context)
        if cres is None:
            target_context.refresh()            # a miss: numba compiles next
        return cres
    load_overload._edgeinfer = True
    cls.load_overload = load_overload
    return True


def patch_env_rebuild(environment) -> bool:
    """numba.core.environment._rebuild_env (what unpickling a cached kernel's Environment
    calls) without importing the defining module when it is one of numba's own that this
    process has not imported: the environment gets {"__name__": module} for globals. Only
    object-mode code reads an environment's globals (numba.core.pylowering); nopython code
    reads its constants, which are restored as before. A module that is already imported, or
    is not numba's, gives its own globals, as numba does."""
    if not _known() or getattr(environment._rebuild_env, "_edgeinfer", False):
        return False
    import importlib
    Environment, lookup = environment.Environment, environment.lookup_environment

    def _rebuild_env(modname, consts, env_name):
        env = lookup(env_name)
        if env is not None:
            return env
        mod = sys.modules.get(modname)
        if mod is None and not modname.startswith("numba."):
            mod = importlib.import_module(modname)
        env = Environment(mod.__dict__ if mod is not None else {"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        Environment._memo[env_name] = env
        return env
    _rebuild_env._edgeinfer = True
    environment._rebuild_env = _rebuild_env
    return True
