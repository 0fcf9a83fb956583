"""Which hardware torch sees and how much memory it has (`--backend auto` asks it here).

Everything device-specific for cuda and mps lives in this module (memory queries, compute
dtype), so the rest of the torch backend is written once for any `torch.device`.
torch is imported lazily: `cuda_available()` / `mps_available()` work (False),
on machines without torch, and answer False without importing it (~1 s) where the operating
system shows no GPU torch could drive (`gpu_absent`).
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

# what a GPU driver puts on Linux: NVIDIA's device nodes and /proc entry, ROCm's kernel driver
# (torch's cuda API on AMD), WSL's GPU paravirtualisation; a container given a GPU has them too
_LINUX_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd",
                    "/dev/dxg")


class InsufficientMemory(RuntimeError):
    """The model (or its KV cache) does not fit the device's free memory; numbers included."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str            # cuda | mps | cpu
    name: str
    total_bytes: int
    free_bytes: int
    threads: int         # CPU threads torch uses (compute threads on cpu, host side otherwise)

    @property
    def torch_device(self) -> str:
        return "cuda:0" if self.kind == "cuda" else self.kind


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def _cpu_info(threads: int) -> DeviceInfo:
    import platform

    import psutil
    vm = psutil.virtual_memory()
    name = platform.processor() or platform.machine() or "cpu"
    try:  # the marketing name is only in /proc on Linux; fine to miss elsewhere
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return DeviceInfo("cpu", name, int(vm.total), int(vm.available), threads)


def detect(kind: str | None = None) -> DeviceInfo:
    """The best device torch can use (cuda, then mps, then cpu), or the one named by `kind`."""
    torch = _torch()
    threads = torch.get_num_threads() if torch else (os.cpu_count() or 1)
    if torch is not None and kind in (None, "cuda") and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        return DeviceInfo("cuda", torch.cuda.get_device_name(0), int(total), int(free), threads)
    if torch is not None and kind in (None, "mps") and _mps_available(torch):
        # MPS shares system memory; the recommended working-set size is its real budget.
        total = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return DeviceInfo("mps", "Apple GPU (Metal)", total, max(0, total - used), threads)
    if kind not in (None, "cpu"):
        raise InsufficientMemory(f"torch cannot use a {kind!r} device on this machine")
    return _cpu_info(threads)


def _mps_available(torch) -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def compute_dtype(kind: str, override: str | None = None):
    """Weights/activations dtype per device: bf16 on GPUs that have it (Gemma's activations
    overflow fp16), fp16 otherwise, float32 on the CPU (exact parity with the numba backend).
    `override` names a dtype (float32, bfloat16, float16) to use instead."""
    import torch
    if override:
        dt = getattr(torch, override, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"unknown torch dtype {override!r} (use float32, bfloat16 or float16)")
        return dt
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if kind == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device="mps")  # macOS >= 14
            return torch.bfloat16
        except (RuntimeError, TypeError):
            return torch.float16
    return torch.float32


def gpu_absent(kind: str) -> bool:
    """Whether this machine certainly has no `kind` ("cuda" or "mps") device, known without
    torch: `--backend auto` on a CPU-only machine (edgeinfer run, the daemon's loads) then
    skips importing torch, ~1 s of a cold start. Unsure answers False and torch decides."""
    if kind == "mps":
        return not (sys.platform == "darwin" and platform.machine() == "arm64")
    if sys.platform.startswith("linux"):
        return not any(os.path.exists(p) for p in _LINUX_GPU_NODES)
    return sys.platform == "darwin"         # no CUDA on macOS; Windows asks torch


def cuda_available() -> bool:
    if gpu_absent("cuda"):
        return False
    torch = _torch()
    return torch is not None and torch.cuda.is_available()


def mps_available() -> bool:
    if gpu_absent("mps"):
        return False
    torch = _torch()
    return torch is not None and _mps_available(torch)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_fits(info: DeviceInfo, need_bytes: int, what: str, reserve: float = 0.1) -> None:
    """Refuse clearly when `need_bytes` exceeds the free memory less a safety reserve."""
    usable = int(info.free_bytes * (1 - reserve))
    if need_bytes > usable:
        raise InsufficientMemory(
            f"{what} needs {gib(need_bytes)} but {info.kind} ({info.name}) has {gib(info.free_bytes)} "
            f"free of {gib(info.total_bytes)} (keeping {reserve:.0%} in reserve); "
            f"free memory, pick a smaller model or quantization, or use --backend cpu")
