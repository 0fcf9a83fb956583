"""The `edgeinfer` command line.

Each subcommand lives in its own module and registers itself here; handlers take the parsed
arguments and return an exit code. Expected failures (bad files, unknown models, bad input)
raise `UserError` or a domain error with a one-sentence message: the user sees that sentence,
never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from edgeinfer import __version__, startup_gc
from edgeinfer.settings import Settings, SettingsError, current, install


from edgeinfer.cli import info, manage, run, show, store_cmds
from edgeinfer.cli.errors import UserError  # noqa: F401  (re-exported for the commands)
from edgeinfer.tui import command as tui_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeinfer",
        description="Local LLM inference for GGUF models: run, serve, pull, chat.")
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    show.add_commands(subparsers)
    store_cmds.add_commands(subparsers)     # pull list rm cp
    run.add_commands(subparsers)            # run
    manage.add_commands(subparsers)         # serve daemon ps stop
    tui_cmd.add_commands(subparsers)        # tui
    info.add_commands(subparsers)           # info
    return parser


# Domain errors whose message is meant for the user (module, class); looked up only when an
# error happens, so a command never imports a backend it did not use.
_USER_FACING = (
    ("edgeinfer.formats.gguf_file", "GGUFError"),
    ("edgeinfer.store.model_store", "StoreError"),
    ("edgeinfer.backends.torch.device", "InsufficientMemory"),
    ("edgeinfer.runners.llamacpp.context", "LlamaError"),
    ("edgeinfer.runners.choice", "BackendChoiceError"),
)


def _known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [UserError]
    for module, name in _USER_FACING:
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _daemon_allocator(argv: list[str] | None) -> None:
    """`edgeinfer serve` from the command line runs on the C allocator (PYTHONMALLOC=malloc,
    re-executed once with the same arguments and pid). The daemon builds each loaded model's
    tokenizer (a 262k-token vocabulary is ~70 MB of small objects); with Python's own pools
    the freed memory stays fragmented (+12-16 MB after an unload), with malloc, malloc_trim
    hands it back (+1 MB). Engine processes, spawned afterwards, keep Python's allocator."""
    if argv is not None or sys.argv[1:2] != ["serve"] or sys.platform != "linux":
        return
    if os.environ.get("PYTHONMALLOC") == "malloc" and os.environ.get("_EDGEINFER_REEXEC"):
        del os.environ["PYTHONMALLOC"], os.environ["_EDGEINFER_REEXEC"]  # not for children
        return
    try:
        if not Settings.from_env().engine_process:
            return  # in-process engines: their hot Python glue wants Python's allocator
    except SettingsError:
        return      # main() reports it
    env = {**os.environ, "PYTHONMALLOC": "malloc", "_EDGEINFER_REEXEC": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "edgeinfer", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    _daemon_allocator(argv)
    try:
        install(Settings.from_env())       # the one read of the environment
    except SettingsError as e:
        print(f"edgeinfer: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if argv is None and getattr(args, "holds_gc", False):
        # the command line's own process (run, serve): no collection while it loads a model
        # or the server; the command releases it once loaded (edgeinfer/startup_gc.py)
        startup_gc.hold()
    validate = getattr(args, "validate", None)
    if validate is not None:    # cross-option checks: a usage error exits 2 like argparse's
        validate(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except _known_errors() as e:
        print(f"edgeinfer: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # last resort: one line, the details only on request
        if current().debug:
            raise
        print(f"edgeinfer: internal error: {type(e).__name__}: {e} "
              f"(set EDGEINFER_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
