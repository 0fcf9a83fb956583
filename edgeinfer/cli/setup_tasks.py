"""Steps install.sh runs inside the environment: register the bundled model, warm the JIT cache."""
from __future__ import annotations

import sys


def register_bundled() -> None:
    from edgeinfer.store.model_store import Store
    ref = Store().ensure_bundled()
    print(f"    gemma3:270m -> {ref.path}")


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
