"""Kernels compiled ahead of the first request, in steps that report progress.

numba compiles a kernel the first time it is called and keeps the machine code in its disk
cache (NUMBA_CACHE_DIR). A kernel nobody compiled ahead makes some request wait for it, so
the native CPU backend's kernels are compiled in named steps (keys):

- "int8:TYPE", "float:TYPE", "attention:KV", "ops": the backend's matmul kernels per weight
  type, its attention per KV cache type, and the odd ones (edgeinfer.backends.cpu.warmup);
- "model:ARCH:KV": a tiny random-weight model of that architecture family (llama, qwen2,
  qwen3, gemma3) with that KV cache type (f16, q8_0) through the engine: prefill, batched
  and speculative decode, every sampler with a kernel, a grammar mask. The kernels take
  no shapes as constants, so a tiny model compiles what a real one of its family runs.

`install.sh` runs every step (`python -m edgeinfer.cli.setup_tasks warm-kernels`); `edgeinfer
pull` and a model load run the steps that model needs and that are not done (`pending`), so
only a weight type the install did not cover, or a kernel source edited since, compiles
there, with "compiling kernels (k/n)" progress.

A step that finished leaves a marker file beside numba's cache, under a hash of the kernel
sources (their content, location and times, as numba keys its cache on them), numba's
version and this CPU's instruction set: an edit to a kernel, another checkout of the same
sources, or another cache directory, means the steps run again (each reloads from numba's
cache what is still valid, in about a second). Steps run in child processes, never in the
caller's: numba holds the GIL while it compiles (a daemon would stop answering), a parallel
region started from a loader thread would leave an OpenMP team behind (see
backends/cpu/_int8.py), and install can use two processes at once. Each child prints one JSON line per finished step.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.formats.ggml_types import GGMLQuantizationType as Q
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.runners.sampling_params import SamplingParams, with_vocabulary

MODEL_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
KV_TYPES = ("f16", "q8_0")


@dataclass(frozen=True)
class Progress:
    """`done` of `total` steps finished; `label` names the step being compiled now (the
    last one to start), or the last one finished once all are."""
    done: int
    total: int
    label: str
    elapsed: float = 0.0

    @property
    def text(self) -> str:
        return f"compiling kernels ({self.done}/{self.total})"


ProgressFn = Callable[[Progress], None]


class WarmupError(RuntimeError):
    """A step's child process failed (its last lines of output are in the message)."""


# -- which steps ---------------------------------------------------------------------------

def label(key: str) -> str:
    if key.startswith("model:"):
        _, arch, kv = key.split(":")
        return f"{arch} forward, {kv} KV cache"
    from edgeinfer.backends.cpu import warmup as cpu  # lazy: numba, not in the daemon
    return cpu.label(key)


def install_keys() -> list[str]:
    """Every step: what install.sh warms."""
    from edgeinfer.backends.cpu import warmup as cpu  # lazy: numba, not in the daemon
    return cpu.all_keys() + [f"model:{a}:f16" for a in MODEL_ARCHS]


def model_family(arch: str | None) -> str | None:
    """The synthetic architecture whose forward runs the kernels this one does; None for
    encoder models (the "ops" step has their kernels)."""
    if arch in ("bert", "nomic-bert", "gemma-embedding"):
        return None
    if arch in MODEL_ARCHS:
        return arch
    return "llama"          # llama, mistral, smollm and friends: models/llama.py


def keys_for_model(path: str, kv_cache_type: str | None = None, repack: bool | None = None,
                   numerics: str = "ggml") -> list[str]:
    """The steps the native CPU backend needs for this model file with these settings."""
     # lazy: numba kernels load in the engine process and warm-up children, not the daemon
    from edgeinfer.backends.cpu import warmup as cpu
    from edgeinfer.backends.cpu.ops import CpuOps
    gf = read_gguf(str(path))
    try:
        ops = CpuOps(numerics=numerics, repack=repack, kv_cache_type=kv_cache_type)
        keys = cpu.keys_for_model(gf, ops)
        arch = gf.metadata.get("general.architecture")
    finally:
        gf.close()
    family = model_family(arch if isinstance(arch, str) else None)
    if family is None:
        return keys + (["ops"] if "ops" not in keys else [])
    kv = ops.kv_cache_type if ops.kv_cache_type in KV_TYPES else "f16"
    return keys + [f"attention:{kv}", f"model:{family}:{kv}"]


# -- markers -------------------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def sources_hash() -> str:
    """Hash of what the compiled kernels depend on: the kernel and model sources, this
    file, numba's and Python's versions, and the CPU's vector instruction set."""
     # lazy: numba kernels load in the engine process and warm-up children, not the daemon
    import numba

    from edgeinfer.backends.cpu import _int8
    from edgeinfer.backends.cpu import warmup as cpu
    import edgeinfer.models as models
    files = sorted(Path(cpu.__file__).parent.glob("*.py")) + sorted(
        Path(models.__file__).parent.glob("*.py"))
    files += [Path(importlib.util.find_spec(m).origin) for m in KERNEL_MODULES]
    files.append(Path(__file__))
    return files_hash(f"{numba.__version__} {sys.version} {_int8.BEST_ISA}", files)


# the serving core's own numba kernels (outside backends/cpu and models/), located by module
# name so that a move fails loudly rather than leave a file out (engine/sampling.py, listed by
# path after sampling moved to runners/, had kept its edits from invalidating the markers)
KERNEL_MODULES = ("edgeinfer.runners.sampling", "edgeinfer.engine._periodic_tail",
                  "edgeinfer.formats._string_heads")


def files_hash(prefix: str, files) -> str:
    """Hash of `prefix` and each file's content, and of what numba keys its cache entries on
    besides: the file's location (each source directory has a cache directory of its own)
    and its modification time and size (an entry saved for other ones is not loaded). A
    second checkout of the same sources, or a fresh clone where the first one was, compiles
    everything again, and its steps must not read as done."""
    h = hashlib.sha256(prefix.encode())
    for f in files:
        f = Path(f).resolve()
        h.update(str(f).encode())
        try:
            st = f.stat()
            h.update(f"{st.st_mtime!r} {st.st_size}".encode())
            h.update(f.read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:16]


def marker_dir() -> Path:
    """Where finished steps leave their markers: beside numba's cache, one directory per
    sources_hash(); EDGEINFER_WARM_MARKERS (tests, benchmarks) names another base."""
    base = os.environ.get("EDGEINFER_WARM_MARKERS")
    if not base:
        from numba.core.config import CACHE_DIR  # lazy: numba, not in the daemon
        base = os.path.join(CACHE_DIR or os.environ.get("NUMBA_CACHE_DIR")
                            or tempfile.gettempdir(), "edgeinfer-warm")
    return Path(base) / sources_hash()


_MARKERS: Path | None = None       # a child's marker directory, as its parent named it


def _marker(key: str) -> Path:
    return (_MARKERS or marker_dir()) / key.replace(":", "_")


def is_done(key: str) -> bool:
    return _marker(key).exists()


def pending(keys) -> list[str]:
    """The steps among `keys` (in order, each once) not done for the current sources."""
    out: list[str] = []
    for k in keys:
        if k not in out and not is_done(k):
            out.append(k)
    return out


def _mark(key: str, seconds: float) -> None:
    d = _MARKERS or marker_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{key.replace(':', '_')}.{os.getpid()}"
    tmp.write_text(f"{seconds:.2f}\n")
    os.replace(tmp, _marker(key))


# -- running steps (in a child process) ----------------------------------------------------

def run_step(key: str) -> None:
    """Compile one step's kernels in this process."""
    if key.startswith("model:"):
        _, arch, kv = key.split(":")
        _model_step(arch, kv)
    else:
        from edgeinfer.backends.cpu import warmup as cpu  # lazy: in the warm-up child only
        cpu.run(key)


def _stages(keys: list[str], processes: int) -> list[list[list[str]]]:
    """The steps as stages of parts that run at once, one child each. Two children compiling
    one kernel at once would do it twice, so with two processes: first the kernels the other
    steps reuse (the int8 driver, activation quantizer and Q8_0 tiles, which the tiny models'
    matrices are; the GGUF-block drivers); then attention beside the other matmul steps; then
    the forwards of the tiny models (norms, ropes, activations, sampling), two lists."""
    if processes <= 1 or len(keys) <= 2:
        return [[keys]]
    first = [[k] for k in ("int8:Q8_0", "float:F32") if k in keys]
    rest = [k for k in keys if [k] not in first]
    attention = [k for k in rest if k.startswith("attention:")]
    models = [k for k in rest if k.startswith("model:")]
    matmuls = [k for k in rest if k not in attention and k not in models]
    lead = [k for k in models if k.startswith(("model:llama:", "model:qwen"))]
    tail = [k for k in models if k not in lead]
    stages = [first, [attention, matmuls], [lead, tail]]
    return [[part for part in stage if part] for stage in stages if any(stage)]


def prepare(keys, progress: ProgressFn | None = None, processes: int | None = None,
            env: dict | None = None) -> list[str]:
    """Run the pending steps among `keys` in child processes (`processes` at once; None: two
    on a machine with two cores or more when there are eight steps or more, else one);
    `progress` gets a Progress when the work begins and as steps start and finish. Returns
    the steps it ran. Raises WarmupError when a child fails (the kernels then compile on
    first use, as they would have without this)."""
    todo = pending(keys)
    if not todo:
        return []
    if processes is None:
        processes = min(2, os.cpu_count() or 1) if len(todo) >= 8 else 1
    t0 = time.monotonic()
    total = len(todo)
    if progress:
        progress(Progress(0, total, ""))
    done = 0
    current: list[str] = []         # steps started and not finished, oldest first
    lock = threading.Lock()
    failures: list[str] = []

    def follow(proc: subprocess.Popen, tail: list[str]) -> None:
        nonlocal done
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                tail.append(line)
                del tail[:-20]
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with lock:
                if "start" in msg:
                    current.append(msg["start"])
                elif "done" in msg:
                    done += 1
                    if msg["done"] in current:
                        current.remove(msg["done"])
                else:
                    continue
                now = current[-1] if current else msg.get("done", "")
                p = Progress(done, total, label(now), time.monotonic() - t0)
            if progress:
                progress(p)

    for stage in _stages(todo, processes):
        procs = []
        for part in stage:
            cmd = [sys.executable, "-m", "edgeinfer.engine.warmup", "--steps", ",".join(part),
                   "--markers", str(marker_dir())]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env, cwd=str(_ROOT))
            tail: list[str] = []
            th = threading.Thread(target=follow, args=(proc, tail), daemon=True)
            th.start()
            procs.append((proc, th, tail))
        for proc, th, tail in procs:
            rc = proc.wait()
            th.join()
            if rc != 0:
                failures.append(f"exit {rc}: " + " | ".join(tail[-5:]))
        if failures:
            raise WarmupError("compiling kernels failed: " + "; ".join(failures))
    return todo


def prepare_model(path: str, progress: ProgressFn | None = None, kv_cache_type: str | None = None,
                  repack: bool | None = None) -> list[str]:
    """prepare() for what this model file needs (see keys_for_model)."""
    return prepare(keys_for_model(path, kv_cache_type, repack), progress)


def prepare_for_load(path: str, backend: str, kv_cache_type: str | None, repack: bool | None,
                     progress: ProgressFn | None = None, name: str = "") -> None:
    """Before a load: compile, with progress, the CPU kernels this model needs that no
    install, pull or earlier load compiled (child processes). A failure is logged: the
    kernels then compile on first use, as they would have anyway."""
    if backend != "cpu":
        return
    log = logging.getLogger("edgeinfer.engine.warmup")
    name = name or Path(path).name
    try:
        todo = pending(keys_for_model(path, kv_cache_type, repack))
        if todo:
            log.info("compiling %d kernel steps for %s: %s", len(todo), name, ", ".join(todo))
            t0 = time.monotonic()
            prepare(todo, progress)
            log.info("kernels for %s compiled in %.1fs", name, time.monotonic() - t0)
    except Exception as e:          # noqa: BLE001 - never fail a load over a warm-up
        log.warning("compiling kernels ahead for %s failed (%s); they compile on first use",
                    name, e)


# -- the model steps -----------------------------------------------------------------------

# the FFN 8x the width: the tiny model then has a band of prompt lengths whose attention
# block fuses and whose FFN does not (_prompt_lengths), as real models have
N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM = 128, 1024, 4, 2, 64


def _prompt_lengths() -> tuple[int, int]:
    """Prompt lengths past the one-call FFN on the tiny model: the longest whose attention
    block still takes the fused kernels (ops.fused_layer_rows; its FFN runs apart: FusedFFN
    .takes), and one whose step runs the separate ops throughout. Real models reach both
    with chat-sized prompts (Qwen2.5 0.5B: 14-35 tokens, then 36 and more)."""
    from edgeinfer.backends.cpu.ops import PAR_MIN_ELEMENTS     # lazy: numba, warm-up only
    from edgeinfer.backends.cpu.packed import SERIAL_QUANT
    fused = min(PAR_MIN_ELEMENTS, SERIAL_QUANT) // max(N_EMBD, N_HEAD * HEAD_DIM)
    assert SERIAL_QUANT // N_FF < fused - 1, "no band: widen N_FF"
    return fused - 1, fused + 8


def write_tiny_model(path: Path, arch: str) -> Path:
    """A random-weight model of `arch` (llama, qwen2, qwen3, gemma3): Q8_0 matrices, F32
    norms, the shared synthetic vocabulary (edgeinfer/formats/synthetic.py)."""
    from edgeinfer.backends.cpu.quants import random_quant_rows  # lazy: numba, warm-up child only
    from edgeinfer.formats.synthetic import TinyShape, write_tiny_gguf  # lazy: the gguf writer
    rng = np.random.default_rng(0)

    def tensor(name: str, kind: str, dims: tuple, scale: float):
        if kind in ("embd", "mat"):
            return random_quant_rows(Q.Q8_0, dims[0], dims[1], rng), Q.Q8_0
        if kind == "norm":
            return (1.0 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32), None
        return (0.1 * rng.standard_normal(dims[0])).astype(np.float32), None

    layers = 6 if arch == "gemma3" else 2          # gemma3: local and global layers
    shape = TinyShape(N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM, layers, context=512)
    return write_tiny_gguf(path, arch, shape, tensor, file_type=7)


def _model_step(arch: str, kv: str) -> None:
    """A tiny model of `arch` through the engine, as the daemon runs one: a prefill, greedy
    decode with prompt-lookup drafts (several rows a sequence), prompts long enough for the
    separate ops (_prompt_lengths), then sampled requests decoded
    together with every sampler that has a kernel, and a masked (grammar) sample."""
    with tempfile.TemporaryDirectory(prefix="edgeinfer-warm-") as tmp:
        path = write_tiny_model(Path(tmp) / f"{arch}.gguf", arch)
        engine = Engine(str(path), EngineConfig(kv_budget_bytes=8 << 20, max_model_len=256,
                                                kv_cache_type=kv))
        try:
            # repeated words: prompt-lookup drafts, so verify steps run several rows
            prompt = engine.encode_raw("the a of and the a of and " * 4)
            engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))
            for j, n in enumerate(_prompt_lengths(), 1):    # the longer prompts' paths,
                # each from another word on: no block of it in the prefix cache
                engine.generate((prompt * (n // len(prompt) + 2))[j:j + n],
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            params = [
                SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1,
                               max_tokens=4, seed=1, logprobs=2, ignore_eos=True),
                SamplingParams(temperature=0.7, min_p=0.05, dry_multiplier=0.8,
                               stop_on_repetition=True, max_tokens=4, seed=2,
                               ignore_eos=True),
            ]
            for p in params:
                engine.submit(engine.encode_raw("a of the w1 w2"),
                              with_vocabulary(p, engine.tokenizer), lambda out: None)
            engine._drain_commands()
            while engine.scheduler.has_work():
                engine.step()
        finally:
            engine.close()
    _masked_sampling()


def _masked_sampling() -> None:
    """Structured output samples masked rows through kernels of their own."""
    from edgeinfer.runners.sampling import Sampler, SeqSamplingState  # lazy: warm-up child only
    logits = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)
    mask = np.zeros(4096, bool)
    mask[::7] = True
    for temperature in (0.0, 0.8):
        state = SeqSamplingState(SamplingParams(temperature=temperature, top_k=40, top_p=0.9))
        Sampler().sample(logits, [state], [mask])


# -- the child process ---------------------------------------------------------------------

def _child(keys: list[str]) -> int:
    for key in keys:
        t = time.monotonic()
        print(json.dumps({"start": key}), flush=True)
        if not is_done(key):        # another process may have done it meanwhile
            run_step(key)
            _mark(key, time.monotonic() - t)
        print(json.dumps({"done": key, "seconds": round(time.monotonic() - t, 2)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgeinfer.engine.warmup",
                                 description="compile the CPU backend's kernels ahead of use")
    ap.add_argument("--steps", help="comma-separated step keys (run here, in this process)")
    ap.add_argument("--all", action="store_true", help="every step (as install.sh)")
    ap.add_argument("--model", help="the steps this GGUF file needs")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--list", action="store_true", help="print the steps and whether done")
    ap.add_argument("--markers", help=argparse.SUPPRESS)     # a child: its parent's marker dir
    a = ap.parse_args(argv)
    if a.steps:
        global _MARKERS
        _MARKERS = Path(a.markers) if a.markers else None
        return _child([k for k in a.steps.split(",") if k])
    keys = install_keys() if a.all or not a.model else keys_for_model(a.model)
    if a.list:
        for k in keys:
            print(f"{'done   ' if is_done(k) else 'pending'} {k}")
        return 0

    def show(p: Progress) -> None:
        print(f"    {p.text} {p.label} ({p.elapsed:.1f} s)", flush=True)
    prepare(keys, show, a.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
