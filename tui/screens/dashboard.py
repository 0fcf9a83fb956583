"""Dashboard: live sparklines of the engine's figures and the loaded models.

Fed by the app's `stats` reactive (one sample per `/api/stats/stream` event, a few a second);
on mount the panels are filled from the app's recent history so the charts never start empty.
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from ..api import Stats, fmt_bytes, fmt_until
from ..widgets.banner import ConnectionBanner
from ..widgets.metric_panel import MetricPanel


def _pct(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return 100.0 * part / whole


class DashboardScreen(Screen):
    CSS_PATH = "dashboard.tcss"

    BINDINGS = [Binding("c", "clear", "Clear charts")]

    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        with VerticalScroll(id="dash"):
            with Grid(id="panels"):
                yield MetricPanel("tokens/s", id="tps")
                yield MetricPanel("requests", id="requests")
                yield MetricPanel("KV blocks", ceiling=100, id="kv")
                yield MetricPanel("prefix-cache hits", ceiling=100, id="prefix")
                yield MetricPanel("daemon RSS", id="rss")
                yield MetricPanel("system memory", ceiling=100, id="mem")
                yield MetricPanel("GPU memory", ceiling=100, id="gpu")
            yield Static("loaded models", id="loaded-title")
            yield DataTable(id="loaded", cursor_type="row", zebra_stripes=True)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        table = self.query_one("#loaded", DataTable)
        table.add_column("model", key="name")
        table.add_column("memory", key="memory")
        table.add_column("expires", key="expires")
        for sample in list(self.app.stats_history):
            self._push(sample)
        self._fill_models(self.app.stats)
        self.watch(self.app, "stats", self._on_stats, init=False)
        self.set_interval(1.0, lambda: self._fill_models(self.app.stats))

    def _on_stats(self, stats: Stats | None) -> None:
        if stats is None:
            return
        self._push(stats)
        self._fill_models(stats)

    def _push(self, s: Stats) -> None:
        q = self.query_one
        tps = s.tokens_per_s
        q("#tps", MetricPanel).push(tps, f"{tps:.1f} tok/s" if tps is not None else "-")
        run, wait = s.running, s.waiting
        q("#requests", MetricPanel).push(
            (run or 0) + (wait or 0),
            f"{_i(run)} running · {_i(wait)} waiting")
        kv_pct = _pct(s.kv_used, s.kv_total)
        q("#kv", MetricPanel).push(
            kv_pct, f"{_i(s.kv_used)} / {_i(s.kv_total)}"
                    + (f" ({kv_pct:.0f}%)" if kv_pct is not None else ""))
        hit = s.prefix_hit_rate
        q("#prefix", MetricPanel).push(
            hit * 100 if hit is not None else None,
            f"{hit * 100:.1f}% hit rate" if hit is not None else "-")
        q("#rss", MetricPanel).push(s.rss, fmt_bytes(s.rss))
        mem_pct = _pct(s.mem_used, s.mem_total)
        q("#mem", MetricPanel).push(
            mem_pct, f"{fmt_bytes(s.mem_used)} / {fmt_bytes(s.mem_total)}"
                     + (f" ({mem_pct:.0f}%)" if mem_pct is not None else ""))
        gpu = q("#gpu", MetricPanel)
        has_gpu = s.gpu_total is not None or s.gpu_used is not None
        gpu.display = has_gpu
        if has_gpu:
            gpu.push(_pct(s.gpu_used, s.gpu_total),
                     f"{fmt_bytes(s.gpu_used)} / {fmt_bytes(s.gpu_total)}")

    def _fill_models(self, s: Stats | None) -> None:
        table = self.query_one("#loaded", DataTable)
        now = self.app.now()
        rows = [] if s is None else [
            (m.name, "-" if m.status else fmt_bytes(m.memory),
             m.status or fmt_until(m.expires_at, now)) for m in s.models]
        table.clear()
        for row in rows:
            table.add_row(*row)
        title = self.query_one("#loaded-title", Static)
        title.update(f"loaded models ({len(rows)})" if rows else
                     "loaded models: none (a model loads on its first request)")

    def action_clear(self) -> None:
        for panel in self.query(MetricPanel):
            panel.samples.clear()
            panel.push(None, panel.value_text)


def _i(v: int | None) -> str:
    return "-" if v is None else str(v)
