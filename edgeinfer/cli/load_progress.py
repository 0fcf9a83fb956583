"""Progress of what happens before a model's first token: kernels compiling, weights loading.

- `KernelBar`: a rich progress bar on stderr for edgeinfer.engine.warmup's steps (`edgeinfer
  pull`, and `edgeinfer run` without the daemon).
- `LoadWatcher`: while `edgeinfer run` waits for the daemon's first token, polls /api/ps and
  shows the model's load progress ("compiling kernels (3/12)", "loading weights") on stderr,
  on one line that is cleared when the answer starts (a line per change when stderr is not a
  terminal).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any


class KernelBar:
    """A callable taking warmup.Progress events: one bar, steps done of total."""

    def __init__(self, title: str = "compiling kernels") -> None:
        self.title = title
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> "KernelBar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, p) -> None:
        if self.progress is None:
            # lazy: rich (~15 ms of imports) only once there is something to compile
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[step]}"),
                                     console=Console(stderr=True), transient=False)
            self.progress.start()
            self.task = self.progress.add_task(self.title, total=p.total, step="")
        self.progress.update(self.task, completed=p.done, total=p.total, step=p.label)


def matching(models: list[dict], model: str) -> dict | None:
    """The /api/ps entry of a load in progress for `model` (a name as the user typed it)."""
    loading = [m for m in models if isinstance(m, dict) and m.get("state") == "loading"]
    for m in loading:
        name = str(m.get("name", ""))
        if name == model or name == f"{model}:latest" or name.split(":")[0] == model:
            return m
    return loading[0] if len(loading) == 1 else None


class LoadWatcher:
    """Shows the daemon's load progress of `model` until stop() (see the module doc)."""

    def __init__(self, base_url: str, model: str, interval: float = 0.5, out=None) -> None:
        self.base_url, self.model, self.interval = base_url, model, interval
        self.out = out or sys.stderr
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._shown = ""
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LoadWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._shown and self.tty:
            self.out.write("\r\x1b[2K")
            self.out.flush()

    def _show(self, text: str) -> None:
        if text == self._shown or self._stop.is_set():
            return
        self._shown = text
        if self.tty:
            self.out.write("\r\x1b[2K" + text)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def _run(self) -> None:
        t0 = time.monotonic()
        from edgeinfer.cli.client import Client, ClientError  # lazy: httpx, not for KernelBar
        with Client(self.base_url, timeout=5.0) as c:
            while not self._stop.wait(self.interval):
                try:
                    models = c.request("GET", "/api/ps").get("models") or []
                except (ClientError, AttributeError, ValueError):
                    continue
                m = matching(models, self.model)
                if m is None:
                    continue
                lp = m.get("load_progress") or {}
                text = f"loading {m.get('name')}: {lp.get('text') or 'loading'}"
                if lp.get("step") and lp.get("stage") == "compiling kernels":
                    text += f": {lp['step']}"
                self._show(text + f" ({time.monotonic() - t0:.0f} s)" if self.tty else text)
