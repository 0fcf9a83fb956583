"""Steps install.sh runs inside the environment: register the bundled models, warm the JIT cache."""
from __future__ import annotations

import os
import sys
import time

from edgeinfer.store.bundled import BUNDLED
from edgeinfer.store.model_store import Store


def register_bundled() -> None:
    store = Store()
    for b in BUNDLED.values():
        if b.available():
            ref = store.ensure_bundled(b.name)
            print(f"    {b.name} -> {ref.path}")
        else:
            print(f"    {b.name}: not installed ({', '.join(b.missing())})")


def warm_kernels() -> None:
    """Compile every CPU kernel into numba's disk cache (edgeinfer.engine.warmup), in two
    processes: a model pulled later then compiles nothing (or only its new weight types)."""
    from edgeinfer.engine import warmup  # lazy: the engine and numba, for warm-kernels only
    t = time.monotonic()
    keys = warmup.install_keys()
    todo = warmup.pending(keys)
    if not todo:
        print(f"    all {len(keys)} kernel steps are compiled already")
        return

    last = [0]

    def show(p: warmup.Progress) -> None:
        if p.done > last[0]:            # one line per finished step
            last[0] = p.done
            print(f"    {p.text} ({p.elapsed:.0f} s)", flush=True)
    processes = max(1, min(2, os.cpu_count() or 1))
    print(f"    {len(todo)} kernel steps, {processes} processes", flush=True)
    warmup.prepare(todo, show, processes=processes)
    print(f"    kernels compiled in {time.monotonic() - t:.0f} s")


def main(argv: list[str]) -> int:
    tasks = {"register-bundled": register_bundled, "warm-kernels": warm_kernels}
    for name in argv:
        tasks[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
