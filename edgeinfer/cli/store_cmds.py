"""CLI subcommands for the model store: pull, list, rm, cp."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from edgeinfer.cli.run import prepare_kernels
from edgeinfer.runners.choice import resolve_for_file
from edgeinfer.settings import current
from edgeinfer.store.bundled_listing import list_models
from edgeinfer.store.model_store import ModelRef, Store

if TYPE_CHECKING:       # the pull module imports httpx: only `edgeinfer pull` needs it
    from edgeinfer.store.pull import PullProgress


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "pull", help="download or import a model into the store",
        description="SOURCE is a catalog name (gemma3:270m, qwen2.5:0.5b, llama3.2:1b, "
                    "smollm2:135m), hf://OWNER/REPO/FILE.gguf[@REVISION], an http(s) URL to a "
                    ".gguf file, or a local .gguf path.")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("--name", metavar="NAME:TAG", help="register under this name")
    p.add_argument("--sha256", metavar="HEX", help="refuse the file unless it has this digest")
    p.add_argument("--mmproj", metavar="FILE",
                   help="the model's vision projector (an mmproj .gguf: a local path, an "
                        "http(s) URL or hf://OWNER/REPO/FILE.gguf), stored with the model so "
                        "it takes images")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser("list", aliases=["ls"], help="list models in the store")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("rm", help="remove models (their files go when unused)")
    p.add_argument("names", metavar="NAME", nargs="+")
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser("cp", help="copy a model to a new name (shares the file)")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.set_defaults(func=cmd_cp)


# ----- pull -------------------------------------------------------------------------------

class _ProgressView:
    """Renders PullProgress events: a rich bar (bytes, rate, ETA) for events with a total,
    a plain line for the others. Everything goes to stderr so stdout stays scriptable."""

    def __init__(self) -> None:
        from rich.console import Console        # lazy: only `edgeinfer pull` draws bars
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=False)
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> "_ProgressView":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tasks:
            self.progress.stop()

    def __call__(self, ev: PullProgress) -> None:
        if ev.total is not None:
            task = self.tasks.get(ev.status)
            if task is None:
                if not self.tasks:      # start the live display with the first bar only
                    self.progress.start()
                task = self.tasks[ev.status] = self.progress.add_task(ev.status, total=ev.total)
            self.progress.update(task, total=ev.total, completed=ev.completed or 0)
        elif ev.status != "success":
            self.progress.console.print(ev.status, highlight=False)


def _daemon_pull(args: argparse.Namespace, progress: Callable[[PullProgress], None]
                 ) -> bool | None:
    """Pull through a running daemon, so CLI and API share one download and its progress.
    Contract with edgeinfer.cli.client: `daemon_pull(source, name, sha256, progress) -> bool`,
    False when no daemon answers. Local files are always imported here, in-process."""
    from edgeinfer.cli import client     # lazy: http.client, only for a daemon's pull
    return bool(client.daemon_pull(args.source, args.name, args.sha256, progress))


def cmd_pull(args: argparse.Namespace) -> int:
    from edgeinfer.store.pull import pull
    src = args.source
    local = "://" not in src and (src.lower().endswith(".gguf") or Path(src).expanduser().exists())
    with _ProgressView() as view:
        if not local and _daemon_pull(args, view):
            _prepare_kernels(None, args)
            if args.mmproj:
                _pull_projector(args, None)
            return 0
        ref = pull(args.source, name=args.name, sha256=args.sha256, progress=view)
    _prepare_kernels(ref, args)
    print(f"pulled {ref.full_name} ({ref.id}, {human_size(ref.size)})")
    if args.mmproj:
        _pull_projector(args, ref)
    return 0


def _pull_projector(args: argparse.Namespace, ref: ModelRef | None) -> None:
    """--mmproj: the projector goes into the store with the model just pulled."""
    from edgeinfer.store.pull import pull_projector, resolve_source
    store = Store()
    if ref is None:         # pulled through the daemon, into the same store
        ref = store.resolve(str(resolve_source(args.source, args.name, args.sha256,
                                               store).name), allow_path=False)
    ref = pull_projector(store, ref.full_name, args.mmproj)
    proj = ref.manifest["projector"]
    unit = "tile" if proj.get("longest_edge") else "image"
    print(f"vision projector for {ref.full_name}: {proj['projector_type']} "
          f"({proj['tokens_per_image']} tokens per {unit}, {human_size(proj['size'])})")


def _prepare_kernels(ref: ModelRef | None, args: argparse.Namespace) -> None:
    """Compile the CPU kernels the pulled model needs that install did not (its weight
    types, its architecture's forward; edgeinfer.engine.warmup), with a progress bar, so
    its first request does not wait for them. Nothing to do for a model whose kernels are
    compiled, or that the daemon's backend would not run on the native CPU engine."""
    from edgeinfer.store.pull import resolve_source
    try:
        if ref is None:         # pulled through the daemon, into the same store
            store = Store()
            ref = store.resolve(str(resolve_source(args.source, args.name, args.sha256,
                                                   store).name), allow_path=False)
        settings = current()
        if resolve_for_file(str(ref.path), settings.backend, settings.device) != "cpu":
            return
    except Exception:           # noqa: BLE001 - the pull itself succeeded
        return
    prepare_kernels(str(ref.path), "cpu")


# ----- list / rm / cp ---------------------------------------------------------------------

def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB", "MB") else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def human_ago(ts: float, now: float | None = None) -> str:
    secs = max(0, int((now if now is not None else time.time()) - ts))
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400),
                       ("day", 86400), ("hour", 3600), ("minute", 60)):
        if secs >= size:
            k = secs // size
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "Less than a minute ago" if secs >= 1 else "Just now"


def format_list(refs: list[ModelRef], now: float | None = None) -> str:
    rows = [("NAME", "ID", "SIZE", "MODIFIED")]
    rows += [(r.full_name, r.id, human_size(r.size), human_ago(r.modified_at, now)) for r in refs]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}    {b:<{widths[1]}}    {c:<{widths[2]}}    {d}"
                     for a, b, c, d in rows)


def cmd_list(args: argparse.Namespace) -> int:
    print(format_list(list_models(Store())))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = Store()
    for name in args.names:
        ref = store.remove(name)
        print(f"deleted '{ref.full_name}'")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    ref = Store().copy(args.src, args.dst)
    print(f"copied '{args.src}' to '{ref.full_name}'")
    return 0


if __name__ == "__main__":      # pragma: no cover
    sys.exit("use `edgeinfer pull|list|rm|cp`")
