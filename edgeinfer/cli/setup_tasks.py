"""Steps install.sh runs inside the environment: register the bundled models, warm the JIT cache."""
from __future__ import annotations

import sys


def register_bundled() -> None:
    from edgeinfer.store.bundled import BUNDLED
    from edgeinfer.store.model_store import Store
    store = Store()
    for b in BUNDLED.values():
        if b.available():
            ref = store.ensure_bundled(b.name)
            print(f"    {b.name} -> {ref.path}")
        else:
            print(f"    {b.name}: not installed ({', '.join(b.missing())})")


def warm_kernels() -> None:
    try:
        from edgeinfer.backends.cpu import warmup
    except ImportError:
        print("    (no kernels to warm yet)")
        return
    warmup.run()


def main(argv: list[str]) -> int:
    tasks = {"register-bundled": register_bundled, "warm-kernels": warm_kernels}
    for name in argv:
        tasks[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
