"""Backend and device names in one place: `--backend` / `--device`, EDGEINFER_BACKEND /
EDGEINFER_DEVICE and the APIs' `backend` / `device` load options.

Backends: `cpu` (native numba), `torch` or `torch:DEVICE`, `llamacpp`, and `auto`. A device
(`cuda`, `mps`, `cpu`) only means something to torch and to auto: `torch` + `cuda` is
`torch:cuda`; `auto` + `cpu` is the native numba backend (llama.cpp for an architecture without
a native model), `auto` + `cuda`/`mps` is torch on that device. `resolve()` turns a request into
the concrete name the runner loads (`cpu`, `llamacpp`, `torch:cuda|mps|cpu`), so `ps` shows what
really runs and two spellings of one choice share one loaded engine.

Nothing here imports torch unless a torch device has to be looked at.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from edgeinfer.formats.kv_cache_types import KV_BYTES_PER_VALUE

BACKENDS = ("auto", "cpu", "torch", "llamacpp")
DEVICES = ("cuda", "mps", "cpu")


class BackendChoiceError(ValueError):
    """A bad or impossible backend/device request; one sentence, naming the field."""

    def __init__(self, message: str, field: str = "backend"):
        super().__init__(message)
        self.field = field


def takes_device(backend: str) -> bool:
    """Whether a device may be added to this backend name (torch and auto, not torch:X)."""
    return backend in ("torch", "auto")


def check(backend: str, device: str | None = None) -> None:
    """Validate the names alone (no file, no hardware)."""
    base, _, dev = backend.partition(":")
    if base not in BACKENDS or (dev and (base != "torch" or dev not in DEVICES)):
        raise BackendChoiceError(f"unknown backend {backend!r}: use auto, cpu, torch, "
                                 "torch:cuda, torch:mps, torch:cpu or llamacpp", "backend")
    if device is None:
        return
    if device not in DEVICES:
        raise BackendChoiceError(f"unknown device {device!r}: use cuda, mps or cpu", "device")
    if base in ("cpu", "llamacpp"):
        raise BackendChoiceError(f"device {device!r} does not apply to the {base} backend "
                                 "(a device picks where torch runs: use --backend torch or auto)",
                                 "device")
    if dev and dev != device:
        raise BackendChoiceError(f"backend {backend!r} and device {device!r} disagree", "device")


def with_defaults(backend: str | None, device: str | None, default_backend: str,
                  default_device: str | None) -> tuple[str, str | None]:
    """Fill what a request (or a command line) left out from the defaults. A device alone
    keeps a torch default backend and otherwise lets auto place the model on it; a backend
    alone takes the default device when it accepts one."""
    if backend is None and device is None:
        return default_backend, default_device
    if backend is None:
        return (default_backend if takes_device(default_backend) else "auto"), device
    if device is None and takes_device(backend):
        return backend, default_device
    return backend, device


def device_missing(kind: str) -> str | None:
    """Why torch cannot use this device here, or None when it can."""
    try:
        import torch
    except ImportError:
        return (f"device {kind!r} needs torch, which is not installed "
                "(pip install 'edgeinfer[torch]', a CUDA build for cuda)")
    if kind == "cuda" and not torch.cuda.is_available():
        build = "this torch build has no CUDA support" if torch.version.cuda is None \
            else "torch sees no CUDA GPU on this machine"
        return f"device 'cuda' is not available: {build}"
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return "device 'mps' is not available: torch sees no Apple Metal GPU on this machine"
    return None


def require_device(kind: str, field: str = "device") -> None:
    why = device_missing(kind)
    if why:
        raise BackendChoiceError(why, field)


def resolve(backend: str, device: str | None = None, arch: str | None = None,
            native: bool = True, cpu_only: bool = False) -> str:
    """The concrete backend for a model of architecture `arch`: `cpu`, `llamacpp` or
    `torch:cuda|mps|cpu`. Raises BackendChoiceError for bad names, a device that is not
    present, or a device auto cannot honour for this architecture. cpu_only: the file's
    native model runs on the CPU backend only though its architecture's dense files do not
    (a llama file with experts: model_config.cpu_only_file)."""
    check(backend, device)
    field = "device" if device is not None else "backend"
    base, _, dev = backend.partition(":")
    if base == "auto":
        from edgeinfer.formats.model_config import NATIVE_ARCHS
        # native=False: a native architecture whose file uses a feature the native engine
        # lacks (model_config.native_reason): llama.cpp runs it, as a non-native one
        if arch is not None and (arch not in NATIVE_ARCHS or not native):
            if device in (None, "cpu"):
                return "llamacpp"
            raise BackendChoiceError(
                f"architecture {arch!r} has no native model: only the llamacpp backend runs "
                f"it, on the CPU, not on {device!r} (drop the device)", "device")
        from edgeinfer.formats.model_config import CPU_ONLY_ARCHS
        if arch in CPU_ONLY_ARCHS or cpu_only:
            if device in (None, "cpu"):
                return "cpu"
            raise BackendChoiceError(
                f"architecture {arch!r} runs natively on the CPU backend only, not on "
                f"{device!r} (drop the device, or use --backend llamacpp)", "device")
        if device is None:
            return auto_backend()
        if device == "cpu":
            return "cpu"
        require_device(device, field)
        return f"torch:{device}"
    if base == "torch":
        kind = dev or device
        if kind is None:
            missing = device_missing("cpu")
            if missing:
                raise BackendChoiceError("the torch backend needs torch, which is not "
                                         "installed (pip install 'edgeinfer[torch]')", field)
            from edgeinfer.backends.torch.device import detect
            kind = detect().kind
        require_device(kind, field)
        return f"torch:{kind}"
    return base


def auto_backend() -> str:
    """What "auto" picks for a native architecture: torch on cuda, then torch on mps, then
    the numba CPU backend. (Architectures without a native model go to llama.cpp: resolve.)"""
    from edgeinfer.backends.torch.device import cuda_available, mps_available
    if cuda_available():
        return "torch:cuda"
    if mps_available():
        return "torch:mps"
    return "cpu"


def resolve_for_file(path: str, backend: str, device: str | None = None) -> str:
    """resolve() with the architecture read from the GGUF at `path` (only when needed)."""
    if backend.partition(":")[0] != "auto":
        return resolve(backend, device)
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import cpu_only_file
    gf = read_gguf(path)
    try:
        arch = gf.metadata.get("general.architecture")
        cpu_only = cpu_only_file(gf)
    finally:
        gf.close()
    return resolve(backend, device, arch if isinstance(arch, str) else None,
                   native_for_file(path), cpu_only)


def native_for_file(path) -> bool:
    """Whether the native engine runs the file at `path` (its architecture and every feature
    it uses: model_config.native_reason); remembered per path, size and mtime."""
    return _file_facts(path)[0]


def cpu_only_for_file(path) -> bool:
    """Whether the file's native model runs on the CPU backend only though its architecture's
    dense files do not (model_config.cpu_only_file: a llama file with experts)."""
    return _file_facts(path)[1]


def _file_facts(path) -> tuple[bool, bool]:
    import os
    from edgeinfer.formats.gguf_file import GGUFError
    try:
        st = os.stat(path)
        return _facts(str(path), st.st_size, st.st_mtime_ns)
    except (OSError, GGUFError):     # unreadable: the load says why
        return True, False


@functools.lru_cache(maxsize=64)
def _facts(path: str, size: int, mtime_ns: int) -> tuple[bool, bool]:
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import cpu_only_file, native_reason
    gf = read_gguf(path)
    try:
        return native_reason(gf) is None, cpu_only_file(gf)
    finally:
        gf.close()


@dataclass(frozen=True)
class MemoryEstimate:
    """What a load of a file on a resolved backend will hold, before loading it."""
    weights_bytes: int
    kv_bytes_per_value: float     # K or V element in the pool: 2 (f16), 34/32 (q8_0), 4 (f32)
    kv_cache_type: str = "f16"

    def kv_bytes_per_token(self, n_layers: int, n_kv_head: int, head_dim: int) -> int:
        """2 x layers x KV heads x head dim x bytes per value (whole q8_0 blocks)."""
        return round(2 * n_layers * n_kv_head * head_dim * self.kv_bytes_per_value)


def estimate_memory(backend: str, path: str, kv_cache_type: str | None = None,
                    repack: bool | None = None, torch_dtype: str | None = None
                    ) -> MemoryEstimate:
    """The backend's own figures for the file: repacked tiles on the CPU (`repack`: None
    per model), dense tensors in torch's dtype, the GGUF's bytes for llama.cpp; the KV
    pool's bytes per value for `kv_cache_type` (None: f16; torch keeps f16)."""
    from edgeinfer.formats.gguf_file import read_gguf
    kv_type = kv_cache_type or "f16"
    gf = read_gguf(str(path))
    try:
        base = backend.partition(":")[0]
        if base == "llamacpp":
            return MemoryEstimate(sum(t.nbytes for t in gf.tensors.values()),
                                  KV_BYTES_PER_VALUE[kv_type], kv_type)
        from edgeinfer.runners.native import make_ops
        if base == "cpu":
            ops = make_ops(backend, repack=repack, torch_dtype=torch_dtype,
                           kv_cache_type=kv_type)
        else:
            ops = _torch_ops_for_estimate(backend, torch_dtype)
        return MemoryEstimate(ops.weights_nbytes(gf), ops.kv_bytes_per_value,
                              ops.kv_cache_type)
    finally:
        gf.close()


def _torch_ops_for_estimate(backend: str, dtype: str | None):
    from edgeinfer.backends.torch.ops import TorchOps
    return TorchOps(device=backend.partition(":")[2] or None, check_memory=False, dtype=dtype)


def device_of(backend: str) -> str:
    """Where a resolved backend computes: the torch device, else the CPU."""
    base, _, dev = backend.partition(":")
    return dev if base == "torch" and dev else "cpu"


CPU_WEIGHTS = "gguf (quantized)"          # ModelRunner.weights_format's default


def describe_weights(backend: str, weights_format: str | None = None,
                     path: str | None = None, repack: bool | None = None,
                     torch_dtype: str | None = None) -> str:
    """How a resolved backend holds the weights, for `show`: the runner's format name and,
    where it helps, words. `weights_format` is a loaded runner's own; without it, what a load
    of the file at `path` would use (torch: the dtype it would choose on that device)."""
    base = backend.partition(":")[0]
    fmt = weights_format or weights_format_of(backend, path, repack, torch_dtype)
    if base == "cpu" and fmt == CPU_WEIGHTS:
        return f"{fmt}: GGUF quantized blocks, dequantized per matmul"
    if base == "llamacpp":
        return f"{fmt}: GGUF tensors held by llama.cpp"
    if base == "torch":
        return f"{fmt}: dequantized once at load to dense {fmt} on the {device_of(backend)} device"
    return fmt          # the CPU runner's own words (e.g. its repacked int8 layout)


def weights_format_of(backend: str, path: str | None = None, repack: bool | None = None,
                      torch_dtype: str | None = None, layout=None) -> str:
    """The `weights_format` a runner on this resolved backend would report for the file at
    `path`: the numba backend decides its layout per model (repacked int8 tiles on CPUs with
    VNNI when they fit, else the GGUF blocks; `repack` forces it), torch names its dtype
    (`torch_dtype`: None for the device's choice). `layout`: the file's
    cpu_plan.FileLayout, if its caller parsed the file already."""
    base = backend.partition(":")[0]
    if base == "cpu":
        if layout is not None:
            from edgeinfer.backends.cpu_plan import layout_weights_format
            return layout_weights_format(layout, repack)
        return _cpu_weights_format(path, repack)
    if base == "llamacpp":
        return "gguf (llama.cpp)"
    return torch_dtype_name(device_of(backend), torch_dtype)


def _cpu_weights_format(path: str | None, repack: bool | None) -> str:
    """Ask the numba backend what it would do with this file, without loading weights;
    remembered per path, size and mtime (show asks on every call)."""
    if path is None:
        return CPU_WEIGHTS
    try:
        import os
        st = os.stat(path)
        return _cpu_weights_format_of(str(path), st.st_size, st.st_mtime_ns, repack)
    except Exception:       # a prediction only: never fail `show` over it
        return CPU_WEIGHTS


@functools.lru_cache(maxsize=64)
def _cpu_weights_format_of(path: str, size: int, mtime_ns: int, repack: bool | None) -> str:
    # numba-free (backends/cpu_plan.py): the daemon answers this for /api/show
    from edgeinfer.backends.cpu_plan import weights_format_for
    from edgeinfer.formats.gguf_file import read_gguf
    gf = read_gguf(path)
    try:
        return weights_format_for(gf, repack)
    finally:
        gf.close()


def torch_dtype_name(kind: str, requested: str | None = None) -> str:
    """The dtype the torch backend would hold weights in on this device (`requested`:
    Settings.torch_dtype), as torch names it."""
    from edgeinfer.backends.torch.device import compute_dtype
    try:
        dt = compute_dtype(kind, requested)
    except ValueError as e:
        return f"? ({e})"
    return str(dt).removeprefix("torch.")
