"""`edgeinfer info`: the hardware this machine offers, and the backend `--backend auto` picks."""
from __future__ import annotations

import os

from edgeinfer.runners.choice import resolve


def gather() -> dict:
    """Plain facts for printing (and for tests): devices, memory, threads, auto's choice."""
    from edgeinfer.backends.torch.device import detect  # lazy: a backend, for `info` only
    facts: dict = {"cpu": detect("cpu"), "accelerator": None, "torch": None, "llama_cpp": None}
    try:
        import torch  # lazy: torch is optional
        facts["torch"] = torch.__version__
        best = detect()
        if best.kind != "cpu":
            facts["accelerator"] = best
    except ImportError:
        pass
    try:
        import llama_cpp  # lazy: heavy, and optional here
        facts["llama_cpp"] = llama_cpp.__version__
    except ImportError:
        pass
    facts["auto"] = resolve("auto")
    return facts


def _line(label: str, value: str) -> str:
    return f"{label:<14}{value}"


def cmd_info(args) -> int:
    from edgeinfer.backends.torch.device import compute_dtype, gib  # lazy: as in gather()
    f = gather()
    cpu = f["cpu"]
    print(_line("cpu", f"{cpu.name} ({os.cpu_count()} logical cores, torch uses {cpu.threads} threads)"))
    print(_line("memory", f"{gib(cpu.free_bytes)} free of {gib(cpu.total_bytes)}"))
    acc = f["accelerator"]
    if acc is None:
        print(_line("accelerator", "none (no CUDA or Apple MPS device visible to torch)"))
    else:
        dtype = str(compute_dtype(acc.kind)).removeprefix("torch.")
        print(_line("accelerator", f"{acc.kind}: {acc.name}, {gib(acc.free_bytes)} free of "
                                   f"{gib(acc.total_bytes)}, weights as {dtype}"))
    print(_line("torch", f["torch"] or "not installed (pip install 'edgeinfer[torch]')"))
    print(_line("llama.cpp", f["llama_cpp"] or "not installed"))
    print(_line("auto picks", f"{f['auto']} (llamacpp for architectures without a native model)"))
    return 0


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("info", help="show the detected hardware and the backend auto picks")
    p.set_defaults(func=cmd_info)
