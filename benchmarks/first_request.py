"""First request after install: the install's kernel warm-up, then pull + first answer.

    .venv/bin/python benchmarks/first_request.py [--models qwen smollm2] [--runs 1]
        [--skip-install] [--install-cache DIR] [--python PY]

1. Install warm-up: `python -m edgeinfer.cli.setup_tasks warm-kernels` (what install.sh runs)
   into an empty NUMBA_CACHE_DIR; prints its wall and CPU time. That directory is then the JIT
   cache "as install leaves it" (--install-cache DIR: reuse one made before; --skip-install
   with it skips step 1).
2. Per model and run: a copy of that cache, a fresh store (EDGEINFER_HOME) and a daemon port of
   its own; the GGUF served by a local HTTP server on 127.0.0.1 (nothing from the internet).
   `edgeinfer pull http://127.0.0.1:PORT/FILE.gguf` (download, then the kernels that model
   needs and install did not compile), then `edgeinfer run NAME "Why is the sky blue?"` (starts
   the daemon, loads, answers 16 tokens). Prints the pull time, the time from `run` to its
   first output byte and to its end, and pull + first answer; the daemon is stopped after.

The models are the registry test models (.cache/test-models, assembled by install.sh --dev).
Every command is the CLI a user types, in subprocesses, so --repo can point at another checkout
(e.g. `git archive BASE | tar -x -C DIR`, with DIR/edgeinfer/{backends,models,tui} linked to
DIR/{backends,models,tui} as the editable install maps them) to measure it the same way. Absolute
numbers on the shared 2-core machine drift with its load: the script prints `uptime` with each.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RUN_DIR = REPO          # where the commands run (--repo: another checkout)
MODELS = {
    "qwen": REPO / ".cache/test-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "smollm2": REPO / ".cache/test-models/smollm2-135m-instruct-q4_1.gguf",
}


def load() -> str:
    return open("/proc/loadavg").read().split(" ", 3)[:3].__str__() if os.path.exists(
        "/proc/loadavg") else "?"


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass
    port = free_port()
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, port


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def install_warmup(py: str, env: dict, cache: Path) -> tuple[float, float]:
    env = {**env, "NUMBA_CACHE_DIR": str(cache)}
    c0, t0 = children_cpu(), time.monotonic()
    subprocess.run([py, "-m", "edgeinfer.cli.setup_tasks", "warm-kernels"], env=env,
                   cwd=RUN_DIR, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0, children_cpu() - c0


def first_answer(py: str, env: dict, install_cache: Path, model: Path, work: Path) -> dict:
    cache = work / "numba"
    shutil.copytree(install_cache, cache)
    home = work / "home"
    env = {**env, "NUMBA_CACHE_DIR": str(cache), "EDGEINFER_HOME": str(home),
           "EDGEINFER_HOST": f"127.0.0.1:{free_port()}"}
    httpd, port = serve(model.parent)
    cli = [py, "-m", "edgeinfer"]
    try:
        t0 = time.monotonic()
        subprocess.run(cli + ["pull", f"http://127.0.0.1:{port}/{model.name}", "--name",
                              "bench:first"], env=env, cwd=RUN_DIR, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pulled = time.monotonic()
        proc = subprocess.Popen(cli + ["run", "bench:first", "Why is the sky blue?",
                                       "--max-tokens", "16", "--temperature", "0"],
                                env=env, cwd=RUN_DIR, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        first = None
        while True:
            b = proc.stdout.read(1)
            if not b:
                break
            if first is None and not b.isspace():
                first = time.monotonic()
        proc.wait()
        end = time.monotonic()
        if proc.returncode != 0:
            raise RuntimeError(f"edgeinfer run exited {proc.returncode}")
    finally:
        httpd.shutdown()
        subprocess.run(cli + ["daemon", "stop"], env=env, cwd=RUN_DIR,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = first or end
    return {"pull": pulled - t0, "first": first - pulled, "end": end - pulled,
            "total": first - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH",
                    help="another model to measure (e.g. a Q4_K_M of tests/synth.py: q/k/v "
                         "in Q4_K, Q4_K, Q6_K, as Qwen2.5 1.5B's)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--install-cache", type=Path)
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--python", default=str(REPO / ".venv/bin/python"))
    ap.add_argument("--repo", type=Path, default=REPO,
                    help="the checkout whose edgeinfer runs (the commands' working directory)")
    a = ap.parse_args()
    global RUN_DIR
    RUN_DIR = a.repo
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    tmp = Path(tempfile.mkdtemp(prefix="edgeinfer-first-"))
    cache = a.install_cache or tmp / "install-cache"
    print(f"python {a.python}; cores {os.cpu_count()}; load {load()}")
    if not a.skip_install:
        if cache.exists() and any(cache.iterdir()):
            sys.exit(f"{cache} is not empty: the warm-up must start from an empty cache")
        cache.mkdir(parents=True, exist_ok=True)
        wall, cpu = install_warmup(a.python, env, cache)
        print(f"install warm-up into an empty NUMBA_CACHE_DIR: {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU (load after: {load()})")
    models = {name: MODELS[name] for name in a.models}
    models.update((g.split("=", 1)[0], Path(g.split("=", 1)[1]).resolve()) for g in a.gguf)
    for name, path in models.items():
        rows = []
        for i in range(a.runs):
            r = first_answer(a.python, env, cache, path, tmp / f"{name}-{i}")
            rows.append(r)
            print(f"{name} run {i + 1}: pull {r['pull']:.1f} s, run -> first answer "
                  f"{r['first']:.1f} s (done {r['end']:.1f} s); pull + first answer "
                  f"{r['total']:.1f} s (load {load()})", flush=True)
        if len(rows) > 1:
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{name} median of {len(rows)}: pull {med['pull']:.1f} s, first answer "
                  f"{med['first']:.1f} s, pull + first answer {med['total']:.1f} s")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
