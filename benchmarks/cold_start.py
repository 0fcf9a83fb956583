"""Cold start, process start to the first generated token, ours and llama.cpp's, same run.

    .venv/bin/python benchmarks/cold_start.py [--model NAME] [--rounds 5] [--threads 2]

Interleaved rounds (the order turns each round), medians with their ranges:
- llama.cpp: a fresh process imports llama-cpp-python, loads the file and evaluates "Hello"
  (llama.cpp's own cold start, as benchmarks/generate.py's worker does it);
- edgeinfer in process: `edgeinfer run --no-daemon --raw --temperature 0 --max-tokens 1 FILE
  Hello`, the command a user types (its backend choice, kernel check and model load
  included), with the user's repack cache (backends/cpu/packed_cache.py: from the second
  load on, the repacked weights are mapped from disk) and without it
  (EDGEINFER_REPACK_CACHE=0: every load repacks);
- `edgeinfer run` with no daemon running: the command starts one (its first spare engine
  process warming the model asked for), which loads the model: the README's first run;
- `edgeinfer run` through a running daemon, the model not loaded: what a user types after
  the model's keep_alive ran out. Timed from the command's start to the first byte it
  prints (one token, greedy, a one-shot prompt), with two daemons on loopback ports over one
  store: one as shipped (a warm spare engine process waits for the load,
  edgeinfer/engine/spare.py) and one with EDGEINFER_SPARE_RUNNER=0 (each load spawns a
  fresh engine process). Before each timing the model is unloaded and the daemon left idle
  until its spare is warm.
A model's first load repacks its weights and writes them to the repack cache; the rounds
time the loads after it (one untimed load per configuration first; the first load's time
is printed apart). Every row is timed by this process, from starting the command to the
first byte it prints
("first" from a worker, the token from `edgeinfer run`), so Python's start counts alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, fresh_bytecode, start_daemon  # noqa: E402

SPARE_WARM_S = 4.0      # a spare's imports and kernel loads, with margin (2 cores)


def worker_llamacpp(model: str, threads: int) -> None:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    llm.eval(llm.tokenize(b"Hello", add_bos=True))
    print("first", flush=True)


def timed(cmd: list[str], env: dict) -> float:
    """Seconds from starting `cmd` to the first byte it prints (every row is timed so, from
    this process: a worker's own clock would need the kernel's start time, which psutil
    rounds to whole seconds of the boot time)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    first = p.stdout.read(1)
    t = time.perf_counter() - t0
    _, err = p.communicate()
    if not first or p.returncode != 0:
        raise SystemExit(f"{cmd[2:4]} failed ({p.returncode}):\n{err.decode()[-3000:]}")
    return t


def run_worker(model: str, threads: int) -> float:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    return timed([sys.executable, __file__, "--worker", "--model", model,
                  "--threads", str(threads)], env)


def run_local(model: str, threads: int, **extra: str) -> float:
    """`edgeinfer run --no-daemon` on the file: from the command's start to its first byte."""
    env = dict(os.environ, EDGEINFER_THREADS=str(threads), **extra)
    return timed([sys.executable, "-m", "edgeinfer", "run", "--no-daemon", "--raw",
                  "--temperature", "0", "--max-tokens", "1", model, "Hello"], env)


def run_autostart(home: Path, name: str, threads: int) -> float:
    """`edgeinfer run NAME Hello` with no daemon at its address: it starts one over `home`'s
    store (its own, since a daemon's pid file is per store); then that daemon is stopped."""
    env = dict(os.environ, EDGEINFER_HOME=str(home), EDGEINFER_THREADS=str(threads),
               EDGEINFER_HOST=f"127.0.0.1:{free_port()}")
    t = timed([sys.executable, "-m", "edgeinfer", "run", name, "Hello", "--max-tokens", "1",
               "--temperature", "0"], env)
    subprocess.run([sys.executable, "-m", "edgeinfer", "daemon", "stop"], env=env, cwd=REPO,
                   capture_output=True, timeout=60, check=True)
    return t


class Daemon:
    """A daemon on a loopback port over `home`'s store (the CLI finds it by EDGEINFER_HOST)."""

    def __init__(self, home: Path, threads: int, spare: bool):
        self.port = free_port()
        self.env = dict(os.environ, EDGEINFER_HOME=str(home),
                        EDGEINFER_HOST=f"127.0.0.1:{self.port}", EDGEINFER_THREADS=str(threads),
                        EDGEINFER_SPARE_RUNNER="1" if spare else "0")
        self.log = open(home / f"daemon-{self.port}.log", "ab")
        self.proc, self.url = start_daemon(self.env, self.port, self.log)
        self.spare = spare

    def idle_unloaded(self, model: str) -> None:
        """The model unloaded, the daemon idle, its spare (if any) started and warm."""
        httpx.post(self.url + "/api/generate", json={"model": model, "keep_alive": 0},
                   timeout=120)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = httpx.get(self.url + "/api/stats", timeout=10).json()
            if not st["models"] and (not self.spare or st["process"]["spare_engine"]):
                break
            time.sleep(0.2)
        time.sleep(SPARE_WARM_S)

    def time_run(self, model: str) -> float:
        """`edgeinfer run MODEL Hello`: from the command's start to its first printed byte."""
        return timed([sys.executable, "-m", "edgeinfer", "run", model, "Hello",
                      "--max-tokens", "1", "--temperature", "0"], self.env)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def _fmt(v: list[float]) -> str:
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder:0.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_llamacpp(args.model, args.threads)
        return
    fresh_bytecode()
    from edgeinfer.store.model_store import Store
    ref = Store().resolve(args.model)
    path, name = str(ref.path), ref.full_name
    with tempfile.TemporaryDirectory(prefix="edgeinfer-cold-") as tmp:
        home, auto_home = Path(tmp) / "daemons", Path(tmp) / "autostart"
        Store(home).register_file(path, name)
        Store(auto_home).register_file(path, name)
        daemons = {"daemon": Daemon(home, args.threads, spare=True),
                   "daemon, no spare": Daemon(home, args.threads, spare=False)}
        try:
            print(f"model {name}, {args.threads} threads, {args.rounds} interleaved rounds, "
                  f"load average {os.getloadavg()[0]:.1f}")
            # Each model's first load repacks its weights and writes them to the repack
            # cache; every later one maps them. The temporary store's path is new, so that
            # first load happens here, untimed in the rounds: its figure is printed apart.
            for d in daemons.values():
                d.idle_unloaded(name)
            first = daemons["daemon"].time_run(name)
            run_local(path, args.threads)
            print(f"first load of the model through the daemon (repacked, then written to "
                  f"the repack cache): {first:.2f} s")
            runs: dict[str, list[float]] = {"llama.cpp": [], "in process": [],
                                            "in process, no repack cache": [],
                                            "no daemon running": [],
                                            "daemon": [], "daemon, no spare": []}
            kinds = list(runs)
            for r in range(args.rounds):
                order = kinds if r % 2 == 0 else kinds[::-1]
                for k in order:
                    if k == "llama.cpp":
                        runs[k].append(run_worker(path, args.threads))
                    elif k == "in process":
                        runs[k].append(run_local(path, args.threads))
                    elif k == "in process, no repack cache":
                        runs[k].append(run_local(path, args.threads,
                                                 EDGEINFER_REPACK_CACHE="0"))
                    elif k == "no daemon running":
                        runs[k].append(run_autostart(auto_home, name, args.threads))
                    else:
                        daemons[k].idle_unloaded(name)
                        runs[k].append(daemons[k].time_run(name))
                print(f"round {r + 1}: " + ", ".join(f"{k} {runs[k][-1]:.2f}" for k in kinds),
                      flush=True)
        finally:
            for d in daemons.values():
                d.stop()
    base = statistics.median(runs["llama.cpp"])
    print(f"\n| {'cold start, s':44} | {'median (range)':>18} | {'/ llama.cpp':>11} |")
    print(f"|{'-' * 46}|{'-' * 20}|{'-' * 13}|")
    labels = {"llama.cpp": "llama.cpp (llama-cpp-python, in process)",
              "in process": "edgeinfer, in process (run --no-daemon)",
              "in process, no repack cache": "  the same, EDGEINFER_REPACK_CACHE=0",
              "no daemon running": "edgeinfer run, no daemon (it starts one)",
              "daemon": "edgeinfer run, daemon up, model unloaded",
              "daemon, no spare": "  the same, EDGEINFER_SPARE_RUNNER=0"}
    for k in kinds:
        print(f"| {labels[k]:44} | {_fmt(runs[k]):>18} | "
              f"{statistics.median(runs[k]) / base:11.2f} |")
    print(json.dumps({k: statistics.median(v) for k, v in runs.items()}))


if __name__ == "__main__":
    main()
