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


def _known_errors() -> tuple[type[BaseException], ...]:
    from edgeinfer.gguf_file import GGUFError
    errors: list[type[BaseException]] = [UserError, GGUFError]
    try:
        from edgeinfer.store import StoreError
        errors.append(StoreError)
    except ImportError:
        pass
    try:
        from edgeinfer.backends.torch.device import InsufficientMemory
        errors.append(InsufficientMemory)
    except ImportError:
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
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
