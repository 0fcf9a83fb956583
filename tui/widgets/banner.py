"""The connection banner: shown at the top of every screen while the daemon is unreachable."""
from __future__ import annotations

from textual.widgets import Static

from . import load_css


class ConnectionBanner(Static):
    """Mirrors the app's `banner` reactive; hidden while that is empty."""

    DEFAULT_CSS = load_css(__file__)

    def on_mount(self) -> None:
        self.watch(self.app, "banner", self._show, init=True)

    def _show(self, text: str) -> None:
        self.update(text)
        self.set_class(bool(text), "-visible")
