"""The `edgeinfer` command line.

Each subcommand lives in its own module and registers itself here; handlers take the parsed
arguments and return an exit code. Expected failures (bad files, unknown models, bad input)
raise `UserError` or a domain error with a one-sentence message: the user sees that sentence,
never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from edgeinfer import __version__


class UserError(Exception):
    """A failure the user can act on; its message is printed as is."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeinfer",
        description="Local LLM inference for GGUF models: run, serve, pull, chat.")
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    from edgeinfer import show_cmd
    show_cmd.add_commands(subparsers)
    # --- subcommand registrations (one line per module) ---
    from edgeinfer import store_cli; store_cli.add_commands(subparsers)  # pull list rm cp
    from edgeinfer import run_cmd; run_cmd.add_commands(subparsers)  # run
    from edgeinfer import client_cli; client_cli.add_commands(subparsers)  # serve daemon ps stop
    from edgeinfer.tui import command as tui_cmd; tui_cmd.add_commands(subparsers)  # tui
    from edgeinfer import info_cmd; info_cmd.add_commands(subparsers)  # info
    # --- end of registrations ---
    return parser


# Domain errors whose message is meant for the user (module, class); looked up only when an
# error happens, so a command never imports a backend it did not use.
_USER_FACING = (
    ("edgeinfer.gguf_file", "GGUFError"),
    ("edgeinfer.store", "StoreError"),
    ("edgeinfer.backends.torch.device", "InsufficientMemory"),
    ("edgeinfer.backends.llamacpp.context", "LlamaError"),
    ("edgeinfer.backend_choice", "BackendChoiceError"),
)


def _known_errors() -> tuple[type[BaseException], ...]:
    import importlib
    errors: list[type[BaseException]] = [UserError]
    for module, name in _USER_FACING:
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
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
        if os.environ.get("EDGEINFER_DEBUG"):
            raise
        print(f"edgeinfer: internal error: {type(e).__name__}: {e} "
              f"(set EDGEINFER_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
