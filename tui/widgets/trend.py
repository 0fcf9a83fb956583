"""A bar chart of recent samples, several rows tall, scaled from zero.

Unlike a min-max sparkline, a steady value draws as a steady bar at its true height, and
percent figures can use a fixed 0-100 scale (`ceiling`), so the picture reads at a glance.
"""
from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from . import load_css

BLOCKS = " ▁▂▃▄▅▆▇█"


class Trend(Widget):
    DEFAULT_CSS = load_css(__file__)
    COMPONENT_CLASSES = {"trend--bar", "trend--high"}

    data: reactive[tuple[float, ...]] = reactive((), layout=False)

    def __init__(self, ceiling: float | None = None, *, id: str | None = None) -> None:
        """`ceiling`: a fixed top of the scale (100 for percentages; bars past 80% of it
        turn to the warning colour); without it the scale tops at the largest sample."""
        super().__init__(id=id)
        self.ceiling = ceiling

    def set_data(self, values: Sequence[float]) -> None:
        self.data = tuple(values)

    def _levels(self, width: int, height: int) -> list[int]:
        """Bar heights in eighths of a row for the newest `width` samples (right-aligned)."""
        values = list(self.data)[-width:]
        # without a ceiling: a little headroom over the largest sample, so a steady
        # figure reads as a steady bar rather than a solid block
        top = self.ceiling if self.ceiling is not None else max(values, default=0.0) * 1.15
        steps = height * 8
        if top <= 0:
            levels = [0] * len(values)
        else:
            levels = [max(0, min(steps, round(v / top * steps))) for v in values]
            # a non-zero value is never invisible
            levels = [max(lv, 1) if v > 0 else lv for lv, v in zip(levels, values)]
        return [0] * (width - len(levels)) + levels

    def render_line(self, y: int) -> Strip:
        width, height = self.size.width, self.size.height
        if width <= 0 or height <= 0:
            return Strip.blank(width)
        bar = self.get_component_rich_style("trend--bar")
        high = self.get_component_rich_style("trend--high")
        row_from_bottom = height - 1 - y
        segments = []
        for level in self._levels(width, height):
            fill = level - row_from_bottom * 8
            ch = BLOCKS[max(0, min(8, fill))]
            style = high if self.ceiling is not None and level > height * 8 * 0.8 else bar
            segments.append(Segment(ch, style))
        return Strip(Segment.simplify(segments), width)

    def watch_data(self) -> None:
        self.refresh()
