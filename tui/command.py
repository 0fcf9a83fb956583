"""Registers `edgeinfer tui` on the command line; Textual is imported only when it runs."""
from __future__ import annotations

import argparse
from typing import Any


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tui", help="terminal app: chat, live dashboard, models",
        description="Open the terminal app. It talks to the daemon at EDGEINFER_HOST "
                    "(default 127.0.0.1:11435) and starts one on this machine when none "
                    "answers. Keys: F1 chat, F2 dashboard, F3 models, ctrl+q quit.")
    p.add_argument("--host", metavar="HOST:PORT",
                   help="daemon address (default: EDGEINFER_HOST or 127.0.0.1:11435)")
    p.add_argument("--model", help="the model the chat starts with (default: the bundled chat "
                                   "model, qwen2.5-coder:0.5b, when the daemon has it)")
    p.add_argument("--no-start", action="store_true",
                   help="never start a daemon; wait for one to appear")
    p.set_defaults(func=cmd_tui)


def cmd_tui(args: argparse.Namespace) -> int:
    from .app import run  # lazy: Textual loads only when the TUI runs, not with the CLI
    return run(args.host, autostart=not args.no_start, model=args.model)
