"""A dashboard tile: a titled bar chart of one live figure with its current value."""
from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Static

from . import load_css
from .trend import Trend

HISTORY = 120  # samples kept per figure (about a minute at a few samples a second)


class MetricPanel(Vertical):
    """`push(value, text)` adds a sample (None draws as 0) and sets the value line."""

    DEFAULT_CSS = load_css(__file__)

    value_text: reactive[str] = reactive("-")

    def __init__(self, title: str, *, ceiling: float | None = None,
                 id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = title
        self.ceiling = ceiling
        self.samples: deque[float] = deque(maxlen=HISTORY)
        self.pushes = 0          # samples received in all (for tests and rate checks)

    def compose(self) -> ComposeResult:
        yield Static(self.value_text, classes="value")
        yield Trend(self.ceiling)

    def watch_value_text(self, text: str) -> None:
        if self.is_mounted:
            self.query_one(".value", Static).update(text)

    def push(self, value: float | None, text: str) -> None:
        self.samples.append(float(value or 0.0))
        self.pushes += 1
        self.value_text = text
        if self.is_mounted:
            self.query_one(Trend).set_data(self.samples)

    def on_mount(self) -> None:
        self.query_one(".value", Static).update(self.value_text)
        self.query_one(Trend).set_data(self.samples)
