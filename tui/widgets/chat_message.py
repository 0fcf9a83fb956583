"""One message of the conversation: a bordered markdown block titled with its role."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown

from . import load_css


class ChatMessage(Vertical):
    DEFAULT_CSS = load_css(__file__)

    def __init__(self, role: str, content: str = "", **kw) -> None:
        super().__init__(classes=f"-{role}", **kw)
        self.role = role
        self.initial = content
        self.border_title = {"user": "you", "assistant": "assistant"}.get(role, role)

    def compose(self) -> ComposeResult:
        yield Markdown(self.initial)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)
