"""The chat's status line: TTFT, tokens and tokens/s of the current reply, live, and the
daemon's memory (process RSS, KV blocks in use) from the app's stats samples."""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..api import fmt_bytes
from . import load_css

STATE_STYLE = {
    "idle": "dim", "waiting": "yellow", "streaming": "bold green", "done": "green",
    "stopped": "yellow", "error": "bold red",
}


class StreamStatus(Widget):
    """One line. `state` is idle, waiting (request sent), streaming, done, stopped or error."""

    DEFAULT_CSS = load_css(__file__)

    state: reactive[str] = reactive("idle")
    ttft: reactive[float | None] = reactive(None)          # seconds
    tokens: reactive[int] = reactive(0)
    tokens_per_s: reactive[float | None] = reactive(None)
    prompt_tokens: reactive[int | None] = reactive(None)
    detail: reactive[str] = reactive("")
    # the daemon's memory, from the app's stats stream (kept across replies)
    rss: reactive[int | None] = reactive(None)
    kv_used: reactive[int | None] = reactive(None)
    kv_total: reactive[int | None] = reactive(None)

    def reset(self) -> None:
        self.state, self.ttft, self.tokens = "idle", None, 0
        self.tokens_per_s, self.prompt_tokens, self.detail = None, None, ""

    def render(self) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"● {self.state}", style=STATE_STYLE.get(self.state, ""))
        ttft = f"{self.ttft * 1000:.0f} ms" if self.ttft is not None else "-"
        tps = f"{self.tokens_per_s:.1f}" if self.tokens_per_s is not None else "-"
        t.append("  TTFT ", style="dim")
        t.append(ttft, style="bold")
        t.append("  tokens ", style="dim")
        t.append(str(self.tokens), style="bold")
        t.append("  tok/s ", style="dim")
        t.append(tps, style="bold")
        if self.prompt_tokens is not None:
            t.append("  prompt ", style="dim")
            t.append(str(self.prompt_tokens), style="bold")
        if self.detail:
            t.append(f"  {self.detail}", style="dim")
        if self.rss is not None:
            t.append("  RSS ", style="dim")
            t.append(fmt_bytes(self.rss), style="bold")
        if self.kv_total:
            t.append("  KV ", style="dim")
            t.append(f"{self.kv_used or 0}/{self.kv_total}", style="bold")
            t.append(" blocks", style="dim")
        return t
